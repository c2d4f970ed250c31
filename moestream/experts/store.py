"""The narrow interface through which model code reaches routed-expert weights.

Model code calls only `store.ensure(layer, expert_ids)`. This issue provides the
fully resident store; the paging store (device slots <- host <- disk) implements
the same method.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch


class ExpertWeights(NamedTuple):
    """One routed expert's weights on the compute device.

    gate_up: [2 * I, H] (gate rows first, then up rows); down: [H, I].
    """

    gate_up: torch.Tensor
    down: torch.Tensor


class ExpertStore(Protocol):
    """ensure(layer, expert_ids) -> one ExpertWeights per id, in the same order, all on device
    and valid until the next `ensure` call for any layer."""

    def ensure(self, layer: int, expert_ids: Sequence[int]) -> list[ExpertWeights]: ...


class ResidentExpertStore:
    """Every routed expert resident on the device: per MoE layer, stacked
    gate_up [E, 2I, H] and down [E, H, I]. `ensure` returns views and copies nothing.

    Raises:
        KeyError: from `ensure`, for a layer that has no experts set.
    """

    def __init__(self) -> None:
        self._gate_up: dict[int, torch.Tensor] = {}
        self._down: dict[int, torch.Tensor] = {}

    def set_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Install layer `layer`'s experts: gate_up [E, 2I, H], down [E, H, I]."""
        self._gate_up[layer] = gate_up
        self._down[layer] = down

    def ensure(self, layer: int, expert_ids: Sequence[int]) -> list[ExpertWeights]:
        gu, dn = self._gate_up[layer], self._down[layer]
        return [ExpertWeights(gu[e], dn[e]) for e in expert_ids]

    def nbytes(self) -> int:
        """Bytes held by all routed experts."""
        return sum(t.numel() * t.element_size() for d in (self._gate_up, self._down) for t in d.values())
