"""`QuantMethod`: what a quantized weight format tells the loader and the expert executor.

A linear weight W [out, in] named `base` ("model.layers.3.mlp.experts.7.gate_proj") is
stored as a few tensors `base + suffix` (`parts`). `dequantize` turns those tensors back
into W in float32, exactly (each format's formula is exact in float32: a small integer or
an FP8 / FP4 value times a float16, bfloat16, float32 or power-of-two scale). One file per
format: `fp8.py`, `compressed_tensors.py`, `gptq.py`, `mxfp4.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from moestream.config.quantization import QuantizationConfig


@dataclass(frozen=True)
class PartSpec:
    """One stored tensor of a quantized weight: the shapes it may have (the first is the
    canonical one) and the dtypes it may have."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]


@dataclass(frozen=True)
class IntWeights:
    """A weight-only integer matrix W [out, in] in the form the fused CPU kernel reads
    (`kernels/fused_moe.py`, `fused_moe_int`): W = (q - zero) * scale in float32, one scale
    (and zero point) per `group_size` columns of a row (0: one per row).

    q: [out, >= in * bits / 8 bytes], any integer dtype (its bytes are read), contiguous rows.
        bits 8: a byte per value, read as int8 after XOR with `flip` (0; 128 for unsigned
        bytes offset by 128); bits 4: two values per byte, low nibble first, each minus 8.
    scale: [out, G] float32, G = ceil(in / group_size). zero: [out, G] float32, or None
    (symmetric). shape: (out, in).
    """

    shape: tuple[int, int]
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    flip: int
    group_size: int


class TensorIndex(Protocol):
    """The loader's view of a checkpoint: which tensors it holds and their dtypes."""

    def __contains__(self, name: str) -> bool: ...

    def dtype(self, name: str) -> torch.dtype: ...


class QuantMethod(Protocol):
    """A quantized weight format.

    name: the config's description (for messages).
    experts_only: the format quantizes routed experts only (MXFP4: gpt-oss keeps the rest in bf16).
    fused_experts: routed experts are stored fused per layer ([E, ...] tensors; MXFP4).
    is_quantized(index, base) -> whether weight `base` is stored quantized in the checkpoint.
    parts(base, shape) -> {suffix: PartSpec} of the tensors holding W [out, in] = shape.
    dequantize(parts, shape) -> W [out, in] float32 from {suffix: tensor}, exactly.
    int_weights(parts, shape) -> the same W as `IntWeights` for the fused CPU kernel, or None
        where the format has no such form (FP8, FP4, GPTQ's transposed packing).
    """

    name: str
    experts_only: bool
    fused_experts: bool

    def is_quantized(self, index: TensorIndex, base: str) -> bool: ...

    def parts(self, base: str, shape: tuple[int, int]) -> dict[str, PartSpec]: ...

    def dequantize(self, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor: ...

    def int_weights(self, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> IntWeights | None: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Float8Decoder:
    """float8_e4m3fn -> float32 through a 256-entry table of torch's own conversion of every
    code (so the values are identical), one table per device. On CPU, torch converts FP8
    element by element in scalar code; the table lookup (`index_select`) is about 6x faster."""

    def __init__(self) -> None:
        self._tables: dict[torch.device, torch.Tensor] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """t: float8_e4m3fn [...] -> float32 [...]."""
        table = self._tables.get(t.device)
        if table is None:
            codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
            table = self._tables[t.device] = codes.float().to(t.device)  # [256]
        return table.index_select(0, t.reshape(-1).view(torch.uint8).int()).view(t.shape)


def check_float8() -> None:
    """Refuse FP8 checkpoints on a torch build whose CPU cannot convert float8_e4m3fn.

    Raises:
        ValueError: torch has no float8_e4m3fn, or converting it to float32 fails.
    """
    try:
        torch.zeros(1, dtype=torch.float8_e4m3fn).float()
    except (AttributeError, RuntimeError, TypeError) as e:
        raise ValueError(f"this torch build ({torch.__version__}) cannot read float8_e4m3fn weights ({e}); "
                         "install a torch with FP8 support (2.1 or newer), or use a bf16 copy of the checkpoint") from e
