"""MXFP4 routed experts (OCP Microscaling FP4, gpt-oss's `quant_method: mxfp4`).

Stored fused per layer, as gpt-oss does: `{name}_blocks` uint8 [E, out, in / 32, 16] (two
e2m1 values per byte, the low nibble first) and `{name}_scales` uint8 [E, out, in / 32]
(an e8m0 exponent per block of 32 values, bias 127), for `gate_up_proj` [2I, H] and
`down_proj` [H, I]. W = e2m1 value * 2^(scale - 127), in float32 (transformers'
`integrations/mxfp4.py` `convert_moe_packed_tensors`; OCP MX spec v1.0).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moestream.config.quantization import QuantizationConfig
from moestream.quantization.method import PartSpec, TensorIndex

BLOCK = 32
# e2m1: sign, 2 exponent bits, 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class MXFP4Method:
    experts_only = True
    fused_experts = True

    def __init__(self, config: QuantizationConfig) -> None:
        self.name = config.describe()
        self._lut = torch.tensor(FP4_VALUES, dtype=torch.float32)

    def is_quantized(self, index: TensorIndex, base: str) -> bool:
        return base + "_blocks" in index

    def parts(self, base: str, shape: tuple[int, int]) -> dict[str, PartSpec]:
        out, inp = shape
        if inp % BLOCK:
            raise ValueError(f"MXFP4 weight '{base}' is [{out}, {inp}]; its input size must be a multiple of {BLOCK}")
        return {"_blocks": PartSpec(((out, inp // BLOCK, BLOCK // 2),), (torch.uint8,)),
                "_scales": PartSpec(((out, inp // BLOCK),), (torch.uint8,))}

    def int_weights(self, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> None:
        """None: FP4 values: the kernel reads integers."""
        return None

    def dequantize(self, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """W [out, in] float32 from e2m1 nibbles and e8m0 block exponents."""
        out, inp = shape
        blocks = parts["_blocks"].long()  # [out, in / 32, 16]
        lut = self._lut.to(blocks.device)
        values = torch.stack((lut[blocks & 0x0F], lut[blocks >> 4]), dim=-1)  # [out, in / 32, 16, 2]
        exponent = parts["_scales"].long() - 127  # [out, in / 32]
        w = torch.ldexp(values.reshape(out, inp // BLOCK, BLOCK), exponent.unsqueeze(-1).float())
        return w.reshape(out, inp)
