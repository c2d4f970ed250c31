"""The vision tower of a multimodal checkpoint: transformers' own `Qwen3_5MoeVisionModel`
(a dense ViT with 2-D rotary positions and a 2 x 2 patch merger), filled from the
checkpoint's `model.visual.*` tensors by moestream's reader. Its weights stay on the device
(small against the experts)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from moestream.config import MultiModalConfig
from moestream.multimodal.inputs import MultiModalItem

if TYPE_CHECKING:
    from moestream.loader import CheckpointReader

logger = logging.getLogger("moestream")

VISION_PREFIX = "model.visual."


class VisionEncoder(nn.Module):
    """encode(item) -> [item.length, hidden] (model dtype): the language-model input
    embeddings of one image's placeholder tokens (HF `get_image_features`' pooler output)."""

    def __init__(self, visual: nn.Module) -> None:
        super().__init__()
        self.visual = visual

    @torch.inference_mode()
    def encode(self, item: MultiModalItem) -> torch.Tensor:
        p = next(self.visual.parameters())
        grid = torch.tensor([item.grid_thw], dtype=torch.int64, device=p.device)  # [1, 3]
        out = self.visual(item.pixel_values.to(device=p.device, dtype=p.dtype), grid_thw=grid)
        return out.pooler_output  # [length, H]


def load_vision_encoder(mm: MultiModalConfig, reader: "CheckpointReader", dtype: torch.dtype,
                        device: torch.device) -> VisionEncoder:
    """Build transformers' vision module on the meta device and read its weights into place.

    Raises:
        ValueError: a `model.visual.*` tensor is missing, misshapen or unreadable (see
            `CheckpointReader`), or the vision config is one transformers rejects.
    """
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeVisionModel,
        Qwen3_5MoeVisionRotaryEmbedding,
    )

    try:
        vcfg = Qwen3_5MoeVisionConfig(**{k: v for k, v in mm.vision_config.items() if k != "model_type"})
    except Exception as e:
        raise ValueError(f"vision_config: transformers rejects it: {' '.join(str(e).split())}") from e
    vcfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        visual = Qwen3_5MoeVisionModel(vcfg)
    num = 0
    for name, param in list(visual.named_parameters()):
        tensor = reader.get(VISION_PREFIX + name, tuple(param.shape)).to(device=device, dtype=dtype)
        module_name, _, leaf = name.rpartition(".")
        visual.get_submodule(module_name)._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        num += tensor.numel() * tensor.element_size()
    # Its only buffers are the rotary inverse frequencies (not in checkpoints): computed again on the device.
    rotary = Qwen3_5MoeVisionRotaryEmbedding(vcfg).to(device)
    visual.rotary_pos_emb = rotary
    leftover = [n for n, b in visual.named_buffers() if b.is_meta]
    if leftover:
        raise ValueError(f"vision tower buffers not in the checkpoint: {leftover}")
    visual.eval()
    logger.info("vision tower: %d blocks, %.1f MiB resident", vcfg.depth, num / 2**20)
    return VisionEncoder(visual)
