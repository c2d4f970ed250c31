"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as HF's Qwen3MoeRMSNorm; the
zero-centred variant of Qwen3-Next / Qwen3.5 (scale by 1 + weight); and the gated RMSNorm
on Gated DeltaNet outputs (transformers' Qwen3NextRMSNormGated)."""

import torch
import torch.nn.functional as F
from torch import nn

from moestream.kernels.norm import cpu_add_rms_norm, cpu_rms_norm


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalised over the last dim.

    With `unit_offset` (Qwen3-Next, Qwen3.5-MoE) the scale is (1 + weight), applied in
    float32 before casting back, as transformers' Qwen3NextRMSNorm.

    Input [..., D] any float dtype; output same shape and dtype. With `cpu_kernel` (set by
    `set_cpu_norm`) a contiguous float32 / bf16 input in the weight's dtype takes one C++ call
    (`kernels/norm.py`): the same values but for the order of the sum of squares.
    """

    cpu_kernel = False  # moestream's C++ RMSNorm (`set_cpu_norm`), set per model

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        return self.cpu_kernel and x.dtype == self.weight.dtype and x.is_contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel_takes(x):
            return cpu_rms_norm(x, self.weight, self.eps, self.unit_offset)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = residual + x (both [..., D], one dtype): the residual stream
        and its norm, in one C++ call where `forward` would take the kernel (vLLM's
        fused_add_rms_norm, out of place)."""
        if self._kernel_takes(x) and residual.dtype == x.dtype and residual.is_contiguous() and (
                residual.shape == x.shape):
            return cpu_add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)
        h = residual + x
        return h, self(h)


def set_cpu_norm(model: nn.Module, on: bool) -> None:
    """Route every `RMSNorm` of `model` whose weight is a float32 / bf16 CPU tensor through
    moestream's C++ RMSNorm (`kernels/norm.py`), or never."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.cpu_kernel = on and m.weight.dtype in (torch.float32, torch.bfloat16) and m.weight.device.type == "cpu"


class GatedRMSNorm(nn.Module):
    """y = weight * rmsnorm(x) * silu(gate): norm before gate, over the last dim.

    forward(x [..., D], gate [..., D]) -> [..., D] in x's dtype.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * x32.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)
