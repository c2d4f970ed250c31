"""All routed experts resident on the device: the store of a budget that covers them all.
The hot path pays almost nothing: `ensure` returns views; `on_route` feeds a routing recorder
and counts hits on the device (no host sync), read when `stats` is asked."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moestream.experts.interface import ExpertWeights, PackedExpert, PackedLayout
from moestream.experts.trace import RoutingRecorder  # noqa: TC001


class ResidentExpertStore:
    """Per MoE layer, stacked gate_up [E, 2I, H] and down [E, H, I], or for a quantized
    checkpoint the packed experts [E, nbytes] uint8 (`set_packed_layer`); `ensure` copies nothing.

    Hits are counted as the paged store counts them (`ExpertStats`): one per distinct expert
    a layer's forward routes to (the experts the paged executor `ensure`s), every one a hit.
    So for the same routing, resident hits = paged hits + misses.

    Raises:
        KeyError: from `ensure`, for a layer that has no experts set.
    """

    lookahead = False

    def __init__(self, recorder: RoutingRecorder | None = None) -> None:
        self._gate_up: dict[int, torch.Tensor] = {}
        self._down: dict[int, torch.Tensor] = {}
        self._packed: dict[int, torch.Tensor] = {}  # layer -> [E, nbytes] uint8
        self.layout: PackedLayout | None = None
        self.recorder = recorder
        self._hits: dict[int, torch.Tensor] = {}  # per layer: 0-dim int64 on the routed ids' device

    def set_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Install layer `layer`'s experts: gate_up [E, 2I, H], down [E, H, I]."""
        self._gate_up[layer] = gate_up
        self._down[layer] = down

    def set_packed_layer(self, layer: int, data: torch.Tensor, layout: PackedLayout) -> None:
        """Install layer `layer`'s packed experts: data [E, layout.nbytes] uint8."""
        self._packed[layer] = data
        self.layout = layout

    def _num_experts(self, layer: int) -> int:
        return (self._packed[layer] if self.layout is not None else self._gate_up[layer]).shape[0]

    def layer_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s stacked experts: (gate_up [E, 2I, H], down [E, H, I])."""
        return self._gate_up[layer], self._down[layer]

    def ensure(self, layer: int, expert_ids: Sequence[int]) -> list[ExpertWeights | PackedExpert]:
        if self.layout is not None:
            return [PackedExpert(self._packed[layer][e], self.layout) for e in expert_ids]
        gu, dn = self._gate_up[layer], self._down[layer]
        return [ExpertWeights(gu[e], dn[e]) for e in expert_ids]

    def resident_view(self, layer: int) -> dict[int, ExpertWeights | PackedExpert]:
        """Every expert of `layer`, by id (all are resident)."""
        if self.layout is not None:
            return dict(enumerate(self.ensure(layer, range(self._num_experts(layer)))))
        gu, dn = self._gate_up[layer], self._down[layer]
        return {e: ExpertWeights(gu[e], dn[e]) for e in range(gu.shape[0])}

    def start(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Nothing to load: every expert is resident."""

    def max_experts_per_call(self) -> int:
        return 1 << 30

    def on_route(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Count the distinct experts of topk_ids [T, k] as hits of `layer` (on the device, no
        host sync) and record the routing if recording."""
        routed = torch.zeros(self._num_experts(layer), dtype=torch.bool, device=topk_ids.device)  # [E]
        count = routed.index_fill_(0, topk_ids.flatten(), True).sum()  # 0-dim int64
        self.hit_counter(layer, topk_ids.device).add_(count)
        if self.recorder is not None:
            self.recorder.record_layer(layer, topk_ids)

    def hit_counter(self, layer: int, device: torch.device) -> torch.Tensor:
        """The 0-dim int64 counter of `layer`'s hits, made (zero) if there is none yet:
        `on_route` and the C++ decode layer add to it in place."""
        if layer not in self._hits:
            self._hits[layer] = torch.zeros((), dtype=torch.int64, device=device)
        return self._hits[layer]

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        pass

    def hint(self, layer: int, expert_ids: Sequence[int]) -> None:
        pass

    def nbytes(self) -> int:
        """Bytes held by all routed experts."""
        return sum(t.numel() * t.element_size() for d in (self._gate_up, self._down, self._packed) for t in d.values())

    def stats(self) -> dict:
        """Expert-cache metrics of a fully resident store: every access is a hit (counted as in
        the class docstring), nothing is missed or read. Reads the device counters (one sync)."""
        hits = int(torch.stack(list(self._hits.values())).sum()) if self._hits else 0
        return {"resident": True, "hit_rate": 1.0, "hits": hits, "misses": 0, "stall_seconds": 0.0, "bytes_read": 0}
