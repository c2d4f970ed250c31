"""The narrow interface through which model code reaches routed-expert weights.

The paged expert executor (`layers/expert_executor.py`) calls `ensure(layer, expert_ids)` for at most `max_experts_per_call()` ids at a
time (a layer whose batch needs more runs in waves), tells the store what the router
chose (`on_route`), and may hint `prefetch(layer, ids)`. Implementations:
`ResidentExpertStore` (everything on the device) and `PagedExpertStore` (device slots <-
host cache <- disk).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:  # the command line's parser reads the policy names through this module, without torch
    import torch

    from moestream.quantization.method import IntWeights

ExpertKey = tuple[int, int]  # (layer, expert): one routed expert of one MoE layer, in every tier


class ExpertWeights(NamedTuple):
    """One routed expert's weights on the compute device.

    gate_up: [2 * I, H] (gate rows first, then up rows); down: [H, I].
    """

    gate_up: torch.Tensor
    down: torch.Tensor


# Byte alignment of each part of a packed expert (and of its size): every part can be viewed
# in its own dtype whatever its place in a stacked [E, nbytes] tensor.
PACKED_ALIGN = 16


class Dequantizer(Protocol):
    """dequantize({suffix: tensor}, (out, in)) -> W [out, in] float32 (a `QuantMethod`);
    int_weights: the same W in the fused CPU kernel's integer form, or None."""

    name: str

    def dequantize(self, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor: ...

    def int_weights(self, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> IntWeights | None: ...


@dataclass(frozen=True)
class PackedPart:
    """One stored tensor of a packed expert: the matrix it belongs to ("gate", "up",
    "down" or a fused "gate_up"), its checkpoint suffix, and where it lies in the expert's
    bytes (`offset`, `nbytes`), with its dtype and shape."""

    matrix: str
    suffix: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PackedLayout:
    """How one routed expert's quantized tensors lie in a flat uint8 buffer of `nbytes`
    (the same for every expert of the model): `parts` in order, each at a multiple of
    PACKED_ALIGN; `matrices`: (name, (out, in)) of the matrices they make, gate/up/down
    or gate_up/down; `method` dequantizes a matrix from its parts."""

    parts: tuple[PackedPart, ...]
    matrices: tuple[tuple[str, tuple[int, int]], ...]
    method: Dequantizer
    nbytes: int

    def views(self, data: torch.Tensor, matrix: str) -> dict[str, torch.Tensor]:
        """{suffix: tensor} of `matrix`'s parts, as views of data (uint8 [nbytes])."""
        return {p.suffix: data[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape)
                for p in self.parts if p.matrix == matrix}


class PackedExpert(NamedTuple):
    """One routed expert kept in its checkpoint's quantized form: data uint8 [layout.nbytes]
    (on the device, in the host cache, or a row of a resident layer's [E, nbytes]); the
    executor dequantizes it (`quantization/packed.py`)."""

    data: torch.Tensor
    layout: PackedLayout


class ExpertStore(Protocol):
    """What the expert executors and SparseMoE's draft pass need from an expert store.

    ensure(layer, expert_ids) -> one ExpertWeights (PackedExpert for a quantized checkpoint) per id, in order, all on the device and
        valid until the next `ensure` call.
    start(layer, expert_ids): begin that `ensure` call early (a paged store starts its disk
        reads and returns); the matching `ensure` then waits for them.
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

    def ensure(self, layer: int, expert_ids: Sequence[int]) -> list[ExpertWeights | PackedExpert]: ...

    def start(self, layer: int, expert_ids: Sequence[int]) -> None: ...

    def max_experts_per_call(self) -> int: ...

    def on_route(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None: ...

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None: ...

    def hint(self, layer: int, expert_ids: Sequence[int]) -> None: ...

    def resident_view(self, layer: int) -> dict[int, ExpertWeights | PackedExpert]: ...
