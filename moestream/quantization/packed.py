"""Routed experts in their packed (quantized) form: `packed_layout` lays out one expert's
stored tensors in a flat buffer, `dequantize_expert` turns a `PackedExpert` into the
`ExpertWeights` the executor multiplies by (a scratch of one expert: 3 * I * H values of
the compute dtype, freed after its matmuls)."""

from __future__ import annotations

import torch

from moestream.experts.interface import PACKED_ALIGN, ExpertWeights, PackedExpert, PackedLayout, PackedPart
from moestream.quantization.method import IntWeights, QuantMethod


def packed_layout(method: QuantMethod, matrices: tuple[tuple[str, tuple[int, int]], ...],
                  parts: list[tuple[str, str, torch.dtype, tuple[int, ...]]]) -> PackedLayout:
    """The layout of one expert from its stored tensors, in order: (matrix, suffix, dtype,
    shape) each. Every part starts at a multiple of PACKED_ALIGN bytes."""
    placed, offset = [], 0
    for matrix, suffix, dtype, shape in parts:
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        placed.append(PackedPart(matrix, suffix, offset, nbytes, dtype, tuple(shape)))
        offset += -(-nbytes // PACKED_ALIGN) * PACKED_ALIGN
    return PackedLayout(tuple(placed), matrices, method, offset)


def dequantize_expert(expert: PackedExpert, dtype: torch.dtype) -> ExpertWeights:
    """The expert's gate_up [2I, H] (gate rows first) and down [H, I] in `dtype`, each
    matrix dequantized in float32 then cast once (so float32 compute sees the exact
    dequantized weights)."""
    layout = expert.layout
    dense = {name: layout.method.dequantize(layout.views(expert.data, name), shape) for name, shape in layout.matrices}
    gate_up = dense["gate_up"] if "gate_up" in dense else torch.cat((dense["gate"], dense["up"]))
    return ExpertWeights(gate_up.to(dtype), dense["down"].to(dtype))


def int_expert(expert: PackedExpert) -> tuple[list[IntWeights], IntWeights] | None:
    """The expert as the fused CPU kernel's integer matrices: (gate_up as one block [2I, H]
    or two, gate then up [I, H] each; down [H, I]), all of one bit width, flip and group
    size; None when its format has no integer form (`QuantMethod.int_weights`)."""
    layout = expert.layout
    mats = {name: layout.method.int_weights(layout.views(expert.data, name), shape) for name, shape in layout.matrices}
    if any(m is None for m in mats.values()):
        return None
    first = next(iter(mats.values()))
    if any((m.bits, m.flip, m.group_size) != (first.bits, first.flip, first.group_size) for m in mats.values()):
        return None
    gate_up = [mats["gate_up"]] if "gate_up" in mats else [mats["gate"], mats["up"]]
    return gate_up, mats["down"]
