"""Dense SwiGLU MLP (HF Qwen3MoeMLP), used by layers listed in `mlp_only_layers`."""

import torch
from torch import nn

from moestream.layers.activation import silu
from moestream.layers.linear import Linear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); x [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the projections' row_tile > 0 is the batch-invariant mode (set per model)
        gate = silu(self.gate_proj(x), invariant=self.gate_proj.row_tile > 0)  # [T, I]
        return self.down_proj(gate * self.up_proj(x))
