"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as HF's Qwen3MoeRMSNorm; the
zero-centred variant of Qwen3-Next / Qwen3.5 (scale by 1 + weight); and the gated RMSNorm
on Gated DeltaNet outputs (transformers' Qwen3NextRMSNormGated)."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalised over the last dim.

    With `unit_offset` (Qwen3-Next, Qwen3.5-MoE) the scale is (1 + weight), applied in
    float32 before casting back, as transformers' Qwen3NextRMSNorm.

    Input [..., D] any float dtype; output same shape and dtype.
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


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
