"""FP8 weights with block-wise scales (DeepSeek-V3, Kimi-K2, Qwen3-FP8, GLM-4.5-FP8:
`quant_method: fp8`, `weight_block_size` [128, 128]) or one scale per tensor.

Stored: `weight` float8_e4m3fn [out, in] and `weight_scale_inv` float32
[ceil(out / Br), ceil(in / Bc)] (block-wise; a weight whose sizes are not multiples of
the block has partial blocks at its edges, e.g. DeepSeek-V3's 576-row
`kv_a_proj_with_mqa`), or `weight_scale` [] / [1] (per tensor). W = weight * scale of
its block, in float32 (DeepSeek-V3's `inference/kernel.py` `weight_dequant`; vLLM's
`fp8.py`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moestream.config.quantization import QuantizationConfig
from moestream.quantization.method import Float8Decoder, PartSpec, TensorIndex, cdiv, check_float8

SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Fp8Method:
    experts_only = False
    fused_experts = False

    def __init__(self, config: QuantizationConfig) -> None:
        check_float8()
        self.block = config.weight_block_size
        self.name = config.describe()
        self.scale_suffix = ".weight_scale_inv" if self.block else ".weight_scale"
        self._decode = Float8Decoder()

    def is_quantized(self, index: TensorIndex, base: str) -> bool:
        """Stored as FP8: its `weight` is float8_e4m3fn (its scale must then be there too)."""
        name = base + ".weight"
        return name in index and index.dtype(name) == torch.float8_e4m3fn

    def parts(self, base: str, shape: tuple[int, int]) -> dict[str, PartSpec]:
        out, inp = shape
        if self.block:
            scale = PartSpec(((cdiv(out, self.block[0]), cdiv(inp, self.block[1])),), SCALE_DTYPES)
        else:
            scale = PartSpec(((), (1,)), SCALE_DTYPES)
        return {".weight": PartSpec(((out, inp),), (torch.float8_e4m3fn,)), self.scale_suffix: scale}

    def int_weights(self, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> None:
        """None: FP8 values: the kernel reads integers."""
        return None

    def dequantize(self, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """W [out, in] float32 = weight * its block's scale."""
        out, inp = shape
        w, scale = self._decode(parts[".weight"]), parts[self.scale_suffix].float()
        if not self.block:
            return w * scale.reshape(())
        br, bc = self.block
        nr, nc = scale.shape
        if out == nr * br and inp == nc * bc:  # whole blocks: broadcast, no [out, in] scale
            return (w.view(nr, br, nc, bc) * scale[:, None, :, None]).view(out, inp)
        scale = scale.repeat_interleave(br, 0)[:out].repeat_interleave(bc, 1)[:, :inp]  # [out, in]
        return w * scale
