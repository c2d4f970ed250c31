"""Dense SwiGLU MLP (HF Qwen3MoeMLP), used by layers listed in `mlp_only_layers`."""

import torch
import torch.nn.functional as F
from torch import nn

from moestream.layers.linear import Linear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); x [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
