"""A dense linear layer on CPU (`linear_cpu.cpp`, `torch.ops.moestream_cpu.linear`), built with
the other CPU kernels (`kernels/build.py`): x [M, K] @ weight [N, K].T on unpacked weights,
float32 accumulation rounded once to x's dtype, each output summed in an order that depends
only on K (the fused MoE kernel's dot products, `gemm.h`), so a row's logits are the same
whatever else is in the batch. `layers/linear.py`'s `Linear` takes it for calls of few rows
under `gemm_backend` (`set_cpu_gemm`), where it beats MKL's float32 matmul on the CPUs
measured (docs/performance.md)."""

from __future__ import annotations

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
