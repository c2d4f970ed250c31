"""`QuantizationConfig`: a checkpoint's `quantization_config`, normalised (plain frozen
dataclass; parsed by `moestream/quantization/config.py`)."""

from __future__ import annotations

from dataclasses import dataclass

# The `quant_method`s moestream reads, and the formats of each.
QUANT_METHODS: tuple[str, ...] = ("fp8", "compressed-tensors", "gptq", "mxfp4")
COMPRESSED_TENSORS_FORMATS: tuple[str, ...] = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


@dataclass(frozen=True)
class QuantizationConfig:
    """How a checkpoint's linear weights are quantized (weights only: activations stay in
    the compute dtype, as HF computes the dequantized checkpoint).

    `method`: one of QUANT_METHODS.
    - "fp8": float8_e4m3fn weights; `weight_block_size` (rows, columns) with a
      `weight_scale_inv` per block (DeepSeek-V3), or None: one `weight_scale` per tensor.
    - "compressed-tensors": `format` one of COMPRESSED_TENSORS_FORMATS; `weight_type`
      "int" or "float"; `bits`; `strategy` "group", "channel" or "tensor"; `group_size`
      (columns per scale, for "group"); `symmetric` (False: a zero point per scale).
    - "gptq": `bits` (4 or 8), `group_size` (-1: one group per column), `desc_act`
      (a `g_idx` permutes the groups), `symmetric`; `zero_offset` 1 for the original
      "gptq" checkpoint format (zeros stored minus one), 0 for "gptq_v2".
    - "mxfp4": OCP MX FP4 (e2m1) values in blocks of 32 with an e8m0 scale each
      (gpt-oss's `*_blocks` / `*_scales`).
    `ignore`: module names or `re:` patterns left unquantized (informational: a weight is
    read as quantized when its quantized tensors are in the checkpoint).
    """

    method: str
    weight_block_size: tuple[int, int] | None = None
    format: str = ""
    weight_type: str = "int"
    bits: int = 0
    strategy: str = ""
    group_size: int = 0
    symmetric: bool = True
    desc_act: bool = False
    zero_offset: int = 0
    ignore: tuple[str, ...] = ()

    def describe(self) -> str:
        """A short name for logs: "fp8 block 128x128", "compressed-tensors int4 group 128" ..."""
        if self.method == "fp8":
            b = self.weight_block_size
            return f"fp8 block {b[0]}x{b[1]}" if b else "fp8 per-tensor"
        if self.method == "compressed-tensors":
            kind = f"{self.weight_type}{self.bits}"
            grain = f"group {self.group_size}" if self.strategy == "group" else self.strategy
            return f"compressed-tensors {self.format} {kind} {grain}{'' if self.symmetric else ' asymmetric'}"
        if self.method == "gptq":
            return f"gptq int{self.bits} group {self.group_size}{' desc_act' if self.desc_act else ''}"
        return self.method
