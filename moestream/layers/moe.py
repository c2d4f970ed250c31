"""Sparse MoE block: router -> top-k -> expert executor -> weighted combine.

The router (`router.py`) scores, selects and weighs; the expert executor
(`expert_executor.py`: resident, grouped matmuls; or paged through the expert store)
computes the chosen experts and their weighted sum. Qwen3-Next / Qwen3.5-MoE add a dense
shared expert scaled by sigmoid(shared_expert_gate(x)) (transformers'
Qwen3NextSparseMoeBlock); DeepSeek and GLM-4.5 add `shared_experts` ungated
(DeepseekV2Moe, Glm4MoeMoE).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from moestream.config import ExpertActivation, RouterConfig
from moestream.layers.activation import sigmoid
from moestream.experts.interface import ExpertStore
from moestream.layers.expert_executor import (
    SWIGLU,
    ExpertBias,
    ExpertExecutor,
    PagedExpertExecutor,
    make_expert_executor,
)
from moestream.layers.linear import Linear
from moestream.layers.mlp import GatedMLP
from moestream.layers.router import TopKRouter


class RoutingModifier(Protocol):
    """The routing-modification point of an approximate expert mode (docs/expert_modes.md):
    modify(layer, num_experts, weights [T, k] float32, ids [T, k] int64) -> (weights, ids,
    keep [T, k] bool or None), after the router's top-k and before the executor. `keep`
    None: nothing was dropped (the tensors may be the router's own). A dropped pair has
    keep False, weight 0 and its token's top-1 expert as id."""

    def modify(self, layer: int, num_experts: int, weights: torch.Tensor, ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


class SparseMoE(nn.Module):
    """forward(x [T, H]) -> [T, H]. Routed experts run on `experts`, the layer's executor
    (`make_expert_executor(store, ...)`); a shared expert of `shared_intermediate_size` (> 0) is resident and always applied:
    gated (`shared_expert` scaled by sigmoid(`shared_expert_gate`(x))) when `shared_gate`,
    else added as is (`shared_experts`). `act`: the experts' gated activation; with
    `act.bias`, their biases are this layer's `expert_bias` (resident, `ExpertBias`) and
    `intermediate_size` is the experts' I."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        layer_idx: int,
        store: ExpertStore,
        shared_intermediate_size: int = 0,
        shared_gate: bool = True,
        router: RouterConfig = RouterConfig(),
        act: ExpertActivation = SWIGLU,
        intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob, router)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        self.shared_experts: GatedMLP | None = None
        if shared_intermediate_size > 0 and shared_gate:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
        elif shared_intermediate_size > 0:
            self.shared_experts = GatedMLP(hidden_size, shared_intermediate_size)
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.layer_idx = layer_idx
        self.expert_bias = ExpertBias(num_experts, hidden_size, intermediate_size) if act.bias else None
        self.experts: ExpertExecutor = make_expert_executor(store, layer_idx, num_experts, act, self.expert_bias)
        self.modifier: RoutingModifier | None = None  # an approximate expert mode, set per model; None: exact

    def set_lookahead(self, next_layer: int, router: TopKRouter) -> None:
        """Gate lookahead for a paged executor: the next MoE layer's index and router (kept in
        a tuple, so that torch does not register that router as a submodule of this layer)."""
        if isinstance(self.experts, PagedExpertExecutor):
            self.experts.lookahead = (next_layer, router)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing: (weights [T, k] float32, expert ids [T, k] int64)."""
        return self.gate(x)

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output [T, H] (x's dtype), or None when the model has none."""
        if self.shared_experts is not None:
            return self.shared_experts(x)
        if self.shared_expert is not None:
            gate = self.shared_expert_gate(x)  # [T, 1]
            return sigmoid(gate, invariant=self.shared_expert_gate.row_tile > 0) * self.shared_expert(x)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: route, then the executor computes the chosen experts, plus the
        shared experts. A paged executor starts its disk reads first (`begin`), so that they
        run while the shared experts compute: the same sum, in the same order."""
        weights, ids = self.route(x)  # [T, k] each
        keep = None
        if self.modifier is not None:
            weights, ids, keep = self.modifier.modify(self.layer_idx, self.num_experts, weights, ids)
        if isinstance(self.experts, PagedExpertExecutor) and (
                self.shared_experts is not None or self.shared_expert is not None):
            self.experts.begin(weights, ids, keep)
        shared = self._shared(x)
        routed = (self.experts.forward(x, weights, ids) if keep is None  # a draft pass's executor takes no keep
                  else self.experts.forward(x, weights, ids, keep)).to(x.dtype)
        return routed if shared is None else routed + shared
