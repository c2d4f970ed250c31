"""GPTQ int4 / int8 weights (AutoGPTQ / GPTQModel checkpoints, `quant_method: gptq`).

Stored, with pack factor p = 32 / bits values per int32 and G groups:
- `qweight` int32 [in / p, out]: value (i, j) in bits (i % p) * bits of row i // p;
- `qzeros` int32 [G, out / p]: zero (g, j) in bits (j % p) * bits of column j // p,
  stored minus one in the original "gptq" checkpoint format (`zero_offset` 1), as is in
  "gptq_v2";
- `scales` [G, out] (float16);
- `g_idx` int32 [in]: the group of each input column (i // group_size without
  `desc_act`; any assignment with it).
W[j, i] = (q[i, j] - zero[g_idx[i], j]) * scale[g_idx[i], j], in float32 (AutoGPTQ's
`dequantize_weight` in `nn_modules/qlinear/__init__.py`; vLLM's `gptq.py`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moestream.config.quantization import QuantizationConfig
from moestream.quantization.method import PartSpec, TensorIndex, cdiv

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class GPTQMethod:
    experts_only = False
    fused_experts = False

    def __init__(self, config: QuantizationConfig) -> None:
        self.config = config
        self.name = config.describe()
        self.pack = 32 // config.bits

    def is_quantized(self, index: TensorIndex, base: str) -> bool:
        return base + ".qweight" in index

    def _groups(self, inp: int) -> int:
        return 1 if self.config.group_size == -1 else cdiv(inp, self.config.group_size)

    def parts(self, base: str, shape: tuple[int, int]) -> dict[str, PartSpec]:
        out, inp = shape
        if inp % self.pack or out % self.pack:
            raise ValueError(f"GPTQ weight '{base}' is [{out}, {inp}]; {self.config.bits}-bit GPTQ packs {self.pack} "
                             f"values per int32, so both sizes must be multiples of {self.pack}")
        g = self._groups(inp)
        return {".qweight": PartSpec(((inp // self.pack, out),), (torch.int32,)),
                ".qzeros": PartSpec(((g, out // self.pack),), (torch.int32,)),
                ".scales": PartSpec(((g, out),), SCALE_DTYPES),
                ".g_idx": PartSpec(((inp,),), (torch.int32, torch.int64))}

    def int_weights(self, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> None:
        """None: GPTQ packs along the input dimension (qweight [in / 8, out]): no contiguous rows."""
        return None

    def dequantize(self, parts: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """W [out, in] float32 from qweight, qzeros, scales and g_idx."""
        out, inp = shape
        bits, mask = self.config.bits, (1 << self.config.bits) - 1
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=parts[".qweight"].device)  # [p]
        q = (parts[".qweight"].unsqueeze(1) >> shifts[None, :, None]) & mask  # [in / p, p, out]
        q = q.reshape(inp, out)
        z = (parts[".qzeros"].unsqueeze(2) >> shifts[None, None, :]) & mask  # [G, out / p, p]
        z = z.reshape(-1, out) + self.config.zero_offset  # [G, out]
        g = parts[".g_idx"].long()  # [in]
        if int(g.min()) < 0 or int(g.max()) >= z.shape[0]:
            raise ValueError(f"GPTQ g_idx holds groups outside 0..{z.shape[0] - 1}")
        w = (q - z[g]).float() * parts[".scales"][g].float()  # [in, out]
        return w.t()
