"""`MultiModalProcessor`: a prompt's images -> pixel values, expanded placeholders, M-RoPE
positions and content hashes (`MultiModalInputs`).

Pixels come from transformers' Qwen2-VL image processor with its Pillow backend
(`Qwen2VLImageProcessorPil`: smart resize to multiples of patch x merge pixels, rescale,
normalise, patchify into (t, h, w) patches), configured from the checkpoint's
`preprocessor_config.json`. It needs neither torchvision nor a GPU; Qwen3.5's hub
processor (`Qwen3VLProcessor`) uses the same image processor's torchvision backend.
Placeholders are expanded as `Qwen3VLProcessor.replace_image_token` does: each
`<|image_pad|>` becomes t * h * w / merge**2 of them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from moestream.config import MultiModalConfig
from moestream.multimodal.inputs import MultiModalInputs, MultiModalItem
from moestream.multimodal.mrope import mrope_positions

# Input images larger than this are refused (decoding them costs memory before any resize).
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
# Images per prompt unless `limit_mm_per_prompt` says otherwise.
DEFAULT_IMAGES_PER_PROMPT = 16
_PREPROCESSOR_KEYS = ("size", "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                      "image_mean", "image_std", "do_resize", "do_rescale", "rescale_factor", "do_normalize",
                      "do_convert_rgb", "resample")


def _as_images(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


class MultiModalProcessor:
    """Preprocesses a prompt's images for a multimodal checkpoint.

    Args:
        model_dir: the checkpoint (its `preprocessor_config.json`, when present, sets the
            image processor's fields; otherwise the vision config's patch sizes and Qwen3.5's
            mean / std of 0.5).
        mm: the checkpoint's `MultiModalConfig`.
        limit_per_prompt: most items per prompt by modality ({"image": N}); vLLM's
            `limit_mm_per_prompt`.
        max_image_pixels: most pixels (width x height) of an input image.

    Raises:
        ValueError: an unreadable `preprocessor_config.json`.
    """

    def __init__(self, model_dir: str, mm: MultiModalConfig, limit_per_prompt: dict[str, int] | None = None,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.mm = mm
        self.limit_per_prompt = {"image": DEFAULT_IMAGES_PER_PROMPT, **(limit_per_prompt or {})}
        self.max_image_pixels = max_image_pixels
        fields: dict[str, Any] = {"patch_size": mm.patch_size, "temporal_patch_size": mm.temporal_patch_size,
                                  "merge_size": mm.spatial_merge_size, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
        path = os.path.join(model_dir, "preprocessor_config.json")
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    fields.update({k: v for k, v in json.load(f).items() if k in _PREPROCESSOR_KEYS})
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
                raise ValueError(f"cannot read {path}: {e}") from e
        self.image_processor = Qwen2VLImageProcessorPil(**fields)
        if self.image_processor.merge_size != mm.spatial_merge_size or self.image_processor.patch_size != mm.patch_size:
            raise ValueError(f"{path}: patch_size / merge_size ({self.image_processor.patch_size}, "
                             f"{self.image_processor.merge_size}) differ from the vision config's "
                             f"({mm.patch_size}, {mm.spatial_merge_size})")

    def check_image(self, image: Any, where: str) -> None:
        """Refuse what is not an image or is too large, before its pixels are decoded.

        Raises:
            ValueError: not a PIL image, or more than `max_image_pixels` pixels; the message
                starts with `where` (which image).
        """
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise ValueError(f"{where} must be a PIL.Image.Image, got {type(image).__name__}")
        w, h = image.size
        if w * h > self.max_image_pixels:
            raise ValueError(f"{where} is {w} x {h} = {w * h} pixels, over the limit of {self.max_image_pixels}; "
                             "send a smaller image")
        if w < 1 or h < 1:
            raise ValueError(f"{where} is empty ({w} x {h} pixels)")

    def _preprocess(self, image: Any, where: str) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """pixel_values [t*h*w, C*tp*p*p] float32 and the (t, h, w) grid of one image."""
        self.check_image(image, where)
        try:
            image.load()
            rgb = image.convert("RGB")
            out = self.image_processor(images=[rgb], return_tensors="pt")
        except (OSError, ValueError, SyntaxError) as e:  # Pillow: truncated or corrupt data
            raise ValueError(f"{where} cannot be decoded: {' '.join(str(e).split())}") from e
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return out["pixel_values"].float().contiguous(), grid  # type: ignore[return-value]

    def process(self, token_ids: Sequence[int], data: Any) -> tuple[list[int], MultiModalInputs | None]:
        """Expand the image placeholders of `token_ids` for the images in `data` (vLLM's
        `multi_modal_data`: {"image": PIL image or list of them}). Returns the expanded ids
        and the inputs (None when `data` has no images).

        Raises:
            ValueError: `data` is not a dict, names an unsupported modality, has more items
                than `limit_per_prompt`, an image is not a PIL image, too large or corrupt, or
                the number of `<|image_pad|>` placeholders in the prompt differs from the
                number of images.
        """
        if not isinstance(data, dict):
            raise ValueError(f"multi_modal_data must be a dict like {{'image': [...]}}, got {type(data).__name__}")
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modality {unknown[0]!r}; supported: 'image'")
        images = _as_images(data.get("image", []))
        limit = self.limit_per_prompt["image"]
        if len(images) > limit:
            raise ValueError(f"the prompt has {len(images)} images, over the limit of {limit} per prompt "
                             "(limit_mm_per_prompt)")
        mm = self.mm
        num_placeholders = sum(1 for t in token_ids if t == mm.image_token_id)
        if num_placeholders != len(images):
            raise ValueError(
                f"the prompt has {num_placeholders} image placeholders (token {mm.image_token_id}, '<|image_pad|>' "
                f"inside <|vision_start|> ... <|vision_end|>) but {len(images)} images were given; put one "
                "placeholder per image, as the chat template does")
        if not images:
            return list(token_ids), None
        processed = [self._preprocess(im, f"image {i + 1}") for i, im in enumerate(images)]
        ids: list[int] = []
        items: list[MultiModalItem] = []
        it = iter(processed)
        merge = mm.spatial_merge_size ** 2
        for t in token_ids:
            if t != mm.image_token_id:
                ids.append(t)
                continue
            pixels, grid = next(it)
            n = grid[0] * grid[1] * grid[2] // merge
            digest = hashlib.sha256(b"image" + torch.tensor(grid).numpy().tobytes() + pixels.numpy().tobytes())
            items.append(MultiModalItem("image", len(ids), n, grid, pixels, digest.digest()))
            ids.extend([mm.image_token_id] * n)
        positions, delta = mrope_positions(len(ids), [(x.offset, x.grid_thw) for x in items], mm.spatial_merge_size)
        return ids, MultiModalInputs(tuple(items), positions, delta)
