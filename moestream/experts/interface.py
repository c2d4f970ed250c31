"""The narrow interface through which model code reaches routed-expert weights.

The paged expert executor (`layers/expert_executor.py`) calls `ensure(layer, expert_ids)` for at most `max_experts_per_call()` ids at a
time (a layer whose batch needs more runs in waves), tells the store what the router
chose (`on_route`), and may hint `prefetch(layer, ids)`. Implementations:
`ResidentExpertStore` (everything on the device) and `PagedExpertStore` (device slots <-
host cache <- disk).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:  # the command line's parser reads the policy names through this module, without torch
    import torch

ExpertKey = tuple[int, int]  # (layer, expert): one routed expert of one MoE layer, in every tier


class ExpertWeights(NamedTuple):
    """One routed expert's weights on the compute device.

    gate_up: [2 * I, H] (gate rows first, then up rows); down: [H, I].
    """

    gate_up: torch.Tensor
    down: torch.Tensor


class ExpertStore(Protocol):
    """What the expert executors and SparseMoE's draft pass need from an expert store.

    ensure(layer, expert_ids) -> one ExpertWeights per id, in order, all on the device and
        valid until the next `ensure` call.
    max_experts_per_call() -> how many ids one `ensure` may ask for.
    on_route(layer, topk_ids [T, k] int64, topk_weights [T, k] float32): the router's choice.
    prefetch(layer, expert_ids): a hint that these experts will be needed soon.
    hint(layer, expert_ids): a retention hint, that the next forward will route `layer` to
        these experts (speculative drafts' routing); keep them, load nothing.
    resident_view(layer) -> {expert id: ExpertWeights} of the experts on the device now,
        loading nothing and counting nothing (self-speculative drafts use only these).
    lookahead: True when the model should predict the next layer's experts with its gate.
    """

    lookahead: bool

    def ensure(self, layer: int, expert_ids: Sequence[int]) -> list[ExpertWeights]: ...

    def max_experts_per_call(self) -> int: ...

    def on_route(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None: ...

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None: ...

    def hint(self, layer: int, expert_ids: Sequence[int]) -> None: ...

    def resident_view(self, layer: int) -> dict[int, ExpertWeights]: ...
