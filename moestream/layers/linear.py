"""Weight holders without initialisation: `Linear` and `Embedding`.

Weights are always loaded from a checkpoint, so unlike torch.nn's versions these never run
an init kernel. That keeps model construction on the meta device free of torch's lazily
imported decomposition machinery (whose first import leaves reference cycles that pinned
the constructing frames, and so the engine, until the next gc pass).
"""

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); x [..., in_features] -> [..., out_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Row lookup: ids [T] int64 -> [T, dim]."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
