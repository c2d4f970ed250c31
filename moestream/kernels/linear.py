"""A dense linear layer on CPU (`linear_cpu.cpp`, `torch.ops.moestream_cpu.linear`), built with
the other CPU kernels (`kernels/build.py`): x [M, K] @ weight [N, K].T on unpacked weights,
float32 accumulation rounded once to x's dtype, each output summed in an order that depends
only on K (the fused MoE kernel's dot products, `gemm.h`), so a row's logits are the same
whatever else is in the batch. `layers/linear.py`'s `Linear` takes it for calls of few rows
under `gemm_backend` (`set_cpu_gemm`), where it beats MKL's float32 matmul on the CPUs
measured (docs/performance.md)."""

from __future__ import annotations

import functools

import torch

from moestream.kernels.build import load_cpu_kernels


def cpu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 (contiguous rows) @ weight [N, K] (x's dtype, contiguous,
    not oneDNN-packed).T -> [M, N] in x's dtype.

    Raises:
        RuntimeError: other shapes, dtypes or layouts (the operator's checks), or kernels
            that did not build.
    """
    if not load_cpu_kernels():
        raise RuntimeError("the CPU kernels did not build (see the warning logged); use F.linear")
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    torch.ops.moestream_cpu.linear(x, weight, out)
    return out


def blocked_step(dtype: torch.dtype) -> int:
    """The vector step S of `pack_blocked`'s layout for `dtype` in this build (16 for float32),
    or 0 where there is no blocked kernel (builds without AVX-512, other dtypes, kernels that
    did not build; bf16 weights take `pack_vnni` instead)."""
    if dtype != torch.float32 or not load_cpu_kernels():
        return 0
    return torch.ops.moestream_cpu.blocked_step(dtype)


def pack_blocked(weight: torch.Tensor) -> torch.Tensor:
    """float32 weight [N, K] -> [ceil(N / 16), K / S, 16, S] (S = `blocked_step(weight.dtype)`; rows
    past N zero): each block of 16 output rows stored as one contiguous run, k-chunk by k-chunk, for
    `cpu_linear_blocked`.

    Raises:
        ValueError: no blocked kernel for the dtype in this build, or K not a multiple of S.
    """
    n, k = weight.shape
    s = blocked_step(weight.dtype)
    if s == 0 or k % s:
        raise ValueError(f"no blocked layout for a {weight.dtype} weight of {k} input features here (step {s})")
    padded = torch.cat([weight, weight.new_zeros(-n % 16, k)]) if n % 16 else weight
    return padded.reshape(-1, 16, k // s, s).permute(0, 2, 1, 3).contiguous()


def cpu_linear_blocked(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (contiguous rows) @ W.T for W [out_features, K] held as `pack_blocked(W)` -> [M,
    out_features] in x's dtype, equal to `cpu_linear(x, W)` bit for bit, at any M; written into
    `out` (contiguous, x's dtype) when given.

    Raises:
        RuntimeError: shapes, dtypes or layouts that do not match (the operator's checks).
    """
    if out is None:
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    torch.ops.moestream_cpu.linear_blocked(x, packed, out_features, out)
    return out


@functools.cache
def has_amx() -> bool:
    """Whether this build has AMX-BF16 and Linux granted this process the tile state
    (`cpu_linear_vnni` and the fused MoE kernel then take AMX tiles where the shapes allow)."""
    return load_cpu_kernels() and torch.ops.moestream_cpu.has_amx()


def has_vnni_bf16() -> bool:
    """Whether this build has the bf16 VNNI kernel (`cpu_linear_vnni`: AVX512_BF16)."""
    return load_cpu_kernels() and torch.ops.moestream_cpu.has_vnni_bf16()


def pack_vnni(weight: torch.Tensor) -> torch.Tensor:
    """bf16 weight [N, K] (K even) -> [ceil(N / 128), K / 2, 8, 16, 2] (rows past N zero): for each
    pair of k, 128 outputs' two values side by side (oneDNN's VNNI layout for bf16), for
    `cpu_linear_vnni`.

    Raises:
        ValueError: not bf16, K odd, or no VNNI kernel in this build.
    """
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or k % 2 or not has_vnni_bf16():
        raise ValueError(f"no VNNI layout for a {weight.dtype} weight of {k} input features here")
    padded = torch.cat([weight, weight.new_zeros(-n % 128, k)]) if n % 128 else weight
    return padded.reshape(-1, 8, 16, k // 2, 2).permute(0, 3, 1, 2, 4).contiguous()


def cpu_linear_vnni(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                    bias: torch.Tensor | None = None, amx: bool | None = None,
                    out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 x [M, K] (contiguous rows) @ W.T (+ bias [out_features], any float dtype) for W
    [out_features, K] held as `pack_vnni(W)` -> [M, out_features] bf16: float32 sums, each
    output's k pairs added in order (`vdpbf16ps`), the bias added in float32, rounded once; a
    row's result does not depend on M. amx: through AMX tiles (TDPBF16PS) or AVX512_BF16
    (`vdpbf16ps`); None: AMX where `has_amx()` and K is a multiple of 32. The two sum the same
    pairs in the same order but may round differently in the last bit; each is batch-invariant.
    out_dtype float32: the same bf16 values widened, written in one pass (the bf16 logits'
    `.float()` without the second copy). out: written in place of a new tensor (contiguous
    [M, out_features], bf16 or float32; out_dtype is then its dtype).

    Raises:
        RuntimeError: shapes, dtypes or layouts that do not match (the operator's checks), a
            build without AVX512_BF16, or amx=True without AMX or with K not a multiple of 32.
    """
    if amx is None:
        amx = x.shape[1] % 32 == 0 and has_amx()
    if out is None:
        out = torch.empty(x.shape[0], out_features, dtype=out_dtype, device=x.device)
    torch.ops.moestream_cpu.linear_vnni(x, packed, out_features, bias, amx, out)
    return out
