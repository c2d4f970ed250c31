"""RMSNorm on CPU in one operator call (`norm_cpu.cpp`, `torch.ops.moestream_cpu.rms_norm` and
`add_rms_norm`), built with the other CPU kernels (`kernels/build.py`). `layers/norm.py`'s
`RMSNorm` takes it when `set_cpu_norm` turns it on (the engine does under `gemm_backend`): the
PyTorch path is eight operator calls per norm, ~20 us at decode sizes, most of it per-call
overhead (docs/performance.md)."""

from __future__ import annotations

import torch

from moestream.kernels.build import load_cpu_kernels


def _require() -> None:
    if not load_cpu_kernels():
        raise RuntimeError("the CPU kernels did not build (see the warning logged); use RMSNorm's PyTorch path")


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """x [..., D] float32 or bfloat16, contiguous; weight [D] in x's dtype -> [..., D] in x's
    dtype: weight * dtype(x * r) (or dtype(x * r * (1 + weight)) with `unit_offset`), r = 1 /
    sqrt(mean(x^2) + eps) in float32, per row (transformers' Qwen3MoeRMSNorm / Qwen3NextRMSNorm).

    Raises:
        RuntimeError: another dtype, a non-contiguous x, a mis-shaped weight (the operator's
            checks), or kernels that did not build.
    """
    _require()
    return torch.ops.moestream_cpu.rms_norm(x, weight, eps, unit_offset)


def cpu_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = residual + x rounded to the dtype, as torch's add; y = `cpu_rms_norm(h)`.
    residual: x's shape and dtype, contiguous.

    Raises:
        RuntimeError: as `cpu_rms_norm`, or a residual of another shape or dtype.
    """
    _require()
    return torch.ops.moestream_cpu.add_rms_norm(x, residual, weight, eps, unit_offset)
