"""Rotary position embedding on CPU in one operator call, in place on q and k
(`rotary_cpu.cpp`, `torch.ops.moestream_cpu.apply_rotary`), built with the other CPU kernels
(`kernels/build.py`). `layers/rotary.py`'s `RotaryEmbedding` takes it when `set_cpu_rotary`
turns it on (the engine does under `gemm_backend`)."""

from __future__ import annotations

import torch

from moestream.kernels.build import load_cpu_kernels


def cpu_apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     interleaved: bool) -> None:
    """Rotate the first R dims of every head of q [T, Hq, D] and k [T, Hk, D] (float32 or
    bfloat16, one dtype, last dim contiguous) in place, with the results torch's ops give:
    rotate-half (`interleaved` False): cos, sin [T, R] in q's dtype, x * cos + rotate_half(x) *
    sin rounded op by op; interleaved pairs (DeepSeek): cos, sin [T, R/2] float32, each pair
    rotated in float32 and rounded once.

    Raises:
        RuntimeError: other dtypes, shapes or layouts (the operator's checks), or kernels that
            did not build.
    """
    if not load_cpu_kernels():
        raise RuntimeError("the CPU kernels did not build (see the warning logged); use RotaryEmbedding's PyTorch "
                           "path")
    torch.ops.moestream_cpu.apply_rotary(q, k, cos, sin, interleaved)
