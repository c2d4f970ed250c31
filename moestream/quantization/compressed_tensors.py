"""compressed-tensors weights (llm-compressor's checkpoints, `quant_method:
compressed-tensors`), unpacked with the compressed-tensors library.

Formats (`format`):
- "pack-quantized": int4 / int8 values packed into int32 `weight_packed` [out,
  ceil(in * bits / 32)] (offset by 2^(bits-1)), `weight_scale` [out, groups] and, when
  asymmetric, `weight_zero_point` packed along the rows [ceil(out * bits / 32), groups];
  `weight_shape` [2] holds (out, in).
- "int-quantized" / "naive-quantized": int8 `weight` [out, in], `weight_scale`, int8
  `weight_zero_point` [out, groups] when asymmetric.
- "float-quantized": float8_e4m3fn `weight` [out, in], `weight_scale` [out, 1] (channel)
  or [1] (tensor).
groups = ceil(in / group_size) for the group strategy, 1 for channel; tensor: one scale.
W = (q - zero_point) * scale of q's group, in float32 (compressed-tensors'
`quantization/lifecycle/forward.py` `dequantize`, computed in float32).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moestream.config.quantization import QuantizationConfig
from moestream.quantization.method import Float8Decoder, IntWeights, PartSpec, TensorIndex, cdiv, check_float8

SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CompressedTensorsMethod:
    experts_only = False
    fused_experts = False

    def __init__(self, config: QuantizationConfig) -> None:
        if config.weight_type == "float":
            check_float8()
        self.config = config
        self.name = config.describe()
        self.packed = config.format == "pack-quantized"
        self._decode = Float8Decoder()
        # imported here: the library takes a second or two to import, paid only by its checkpoints
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        self._unpack = unpack_from_int32

    def is_quantized(self, index: TensorIndex, base: str) -> bool:
        """Packed: `weight_packed` is there. Otherwise: `weight` is int8 / FP8 (a float weight
        of a layer the config ignores is read as it is)."""
        if self.packed:
            return base + ".weight_packed" in index
        name = base + ".weight"
        return name in index and index.dtype(name) in (torch.int8, torch.float8_e4m3fn)

    def _groups(self, inp: int) -> int:
        c = self.config
        return cdiv(inp, c.group_size) if c.strategy == "group" else 1

    def parts(self, base: str, shape: tuple[int, int]) -> dict[str, PartSpec]:
        c, (out, inp) = self.config, shape
        if c.strategy == "tensor":
            scale = PartSpec(((1,), ()), SCALE_DTYPES)
        else:
            scale = PartSpec(((out, self._groups(inp)),), SCALE_DTYPES)
        if self.packed:
            parts = {".weight_packed": PartSpec(((out, cdiv(inp * c.bits, 32)),), (torch.int32,)),
                     ".weight_scale": scale, ".weight_shape": PartSpec(((2,),), (torch.int64, torch.int32))}
            if not c.symmetric:
                parts[".weight_zero_point"] = PartSpec(((cdiv(out * c.bits, 32), self._groups(inp)),), (torch.int32,))
            return parts
        dtype = torch.float8_e4m3fn if c.weight_type == "float" else torch.int8
        parts = {".weight": PartSpec(((out, inp),), (dtype,)), ".weight_scale": scale}
        if not c.symmetric:
            parts[".weight_zero_point"] = PartSpec(((out, self._groups(inp)),), (torch.int8,))
        return parts

    def int_weights(self, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> IntWeights | None:
        """W as `IntWeights` (int8 or int4 values read in place; scales and zero points made
        float32 [out, G]), equal to `dequantize`'s W; None for FP8 weights, other bit widths,
        and an asymmetric "tensor" strategy (whose zero point `dequantize` does not read)."""
        c, (out, inp) = self.config, shape
        if c.weight_type == "float" or c.bits not in (4, 8) or (not self.packed and c.bits != 8):
            return None
        zp = parts.get(".weight_zero_point")
        if c.strategy == "tensor" and zp is not None:
            return None
        scale = parts[".weight_scale"].float()
        if c.strategy == "tensor":
            scale, group_size = scale.reshape(1, 1).expand(out, 1), 0
        elif c.strategy == "channel":
            scale, group_size = scale.reshape(out, 1), 0
        else:
            group_size = c.group_size
        zero = None
        if zp is not None:
            if self.packed:
                zp = self._unpack(zp, c.bits, torch.Size((out, self._groups(inp))), packed_dim=0)  # [out, G]
            zero = zp.float().reshape(scale.shape).contiguous()
        q = parts[".weight_packed"] if self.packed else parts[".weight"]
        flip = 0x80 if self.packed and c.bits == 8 else 0  # pack-quantized int8: unsigned bytes offset by 128
        return IntWeights(shape, q, scale.contiguous(), zero, c.bits, flip, group_size)

    def dequantize(self, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """W [out, in] float32 = (q - zero_point) * scale, per group of `group_size` columns."""
        c, (out, inp) = self.config, shape
        if self.packed:
            q = self._unpack(parts[".weight_packed"], c.bits, torch.Size(shape))  # [out, in] int8
        else:
            q = parts[".weight"]
        w = self._decode(q) if q.dtype == torch.float8_e4m3fn else q.float()
        zp = parts.get(".weight_zero_point")
        if zp is not None and self.packed:
            zp = self._unpack(zp, c.bits, torch.Size((out, self._groups(inp))), packed_dim=0)  # [out, G]
        scale = parts[".weight_scale"].float()
        if c.strategy == "tensor":
            return w * scale.reshape(())
        if c.strategy == "group" and inp % c.group_size == 0:  # whole groups: broadcast over [out, G, group]
            g = inp // c.group_size
            w = w.view(out, g, c.group_size)
            if zp is not None:
                w = w - zp.float()[..., None]
            return (w * scale[..., None]).view(out, inp)
        if c.strategy == "group":
            expand = lambda t: t.repeat_interleave(c.group_size, 1)[:, :inp]  # noqa: E731  [out, in]
        else:
            expand = lambda t: t  # noqa: E731  [out, 1] broadcasts
        if zp is not None:
            w = w - expand(zp.float())
        return w * expand(scale)
