"""`MultiModalProcessor`: a prompt's images and videos -> pixel values, expanded
placeholders, M-RoPE positions and content hashes (`MultiModalInputs`).

Pixels come from transformers' Qwen2-VL image processor with its Pillow backend
(`Qwen2VLImageProcessorPil`: smart resize to multiples of patch x merge pixels, rescale,
normalise, patchify into (t, h, w) patches), configured from the checkpoint's
`preprocessor_config.json`. It needs neither torchvision nor a GPU; Qwen3.5's hub
processor (`Qwen3VLProcessor`) uses the same image processor's torchvision backend.
Placeholders are expanded as `Qwen3VLProcessor.replace_image_token` does: each
`<|image_pad|>` becomes t * h * w / merge**2 of them.

Videos follow transformers' `Qwen3VLVideoProcessor` (which needs torchvision) with the same
Pillow operations: every frame resized to the size its `smart_resize` gives for the whole
clip, rescaled and normalised (`video_preprocessor_config.json`), the clip padded to a
multiple of `temporal_patch_size` frames with its last frame, and patchified in its layout.
Frames are taken as given (vLLM's loaders sample them; no resampling here). Each group of
`temporal_patch_size` frames becomes `<{t:.1f} seconds><|vision_start|>` + its tokens +
`<|vision_end|>`, as `Qwen3VLProcessor.replace_video_token`, and is one item: the vision
tower attends within a frame group only, so a group encodes on its own.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moestream.config import MultiModalConfig
from moestream.multimodal.inputs import MultiModalInputs, MultiModalItem
from moestream.multimodal.mrope import mrope_positions

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Input images larger than this are refused (decoding them costs memory before any resize).
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
# Longest side / shortest side of an image at most (transformers' smart_resize refuses more).
MAX_ASPECT_RATIO = 200
# Items per prompt unless `limit_mm_per_prompt` says otherwise.
DEFAULT_IMAGES_PER_PROMPT = 16
DEFAULT_VIDEOS_PER_PROMPT = 1
# Frames of one video at most (Qwen3VLVideoProcessor's max_frames).
MAX_VIDEO_FRAMES = 768
# Frame rate assumed for a video without metadata (Qwen3VLProcessor's default).
DEFAULT_VIDEO_FPS = 24.0
_PREPROCESSOR_KEYS = ("size", "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                      "image_mean", "image_std", "do_resize", "do_rescale", "rescale_factor", "do_normalize",
                      "do_convert_rgb", "resample")
# Qwen3VLVideoProcessor's defaults (transformers' video_processing_qwen3_vl.py).
_VIDEO_DEFAULTS: dict[str, Any] = {"size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
                                   "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                                   "rescale_factor": 1 / 255}


def _as_items(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def _read_json(path: str) -> dict:
    """The JSON object in `path`, or {} when there is no such file.

    Raises:
        ValueError: the file is unreadable or not a JSON object.
    """
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value


def _digest(modality: str, grid: tuple[int, int, int], pixels: torch.Tensor) -> bytes:
    return hashlib.sha256(modality.encode() + np.asarray(grid, dtype=np.int64).tobytes()
                          + pixels.numpy().tobytes()).digest()


def video_timestamps(frames_indices: Sequence[int], fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each frame group: the mean time of its first and last frame, the index
    list padded with its last index to a multiple of `temporal_patch_size`
    (`Qwen3VLProcessor._calculate_timestamps`)."""
    idx = list(frames_indices)
    if len(idx) % temporal_patch_size:
        idx += [idx[-1]] * (temporal_patch_size - len(idx) % temporal_patch_size)
    t = [i / fps for i in idx]
    return [(t[i] + t[i + temporal_patch_size - 1]) / 2 for i in range(0, len(t), temporal_patch_size)]


def patchify_video(frames: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int
                   ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """frames [T, C, H, W] float32 (T a multiple of temporal_patch_size; H, W multiples of
    patch_size * merge_size) -> (pixel rows [t*h*w, C*tp*p*p], grid (t, h, w)), rows ordered
    frame group, merge block, position in block (`Qwen3VLVideoProcessor.patchify`)."""
    n, c, height, width = frames.shape
    t, h, w, m, p, tp = n // temporal_patch_size, height // patch_size, width // patch_size, merge_size, patch_size, \
        temporal_patch_size
    x = frames.reshape(t, tp, c, h // m, m, p, w // m, m, p)  # [t, tp, C, bh, m, p, bw, m, p]
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [t, bh, bw, m, m, C, tp, p, p]
    return x.reshape(t * h * w, c * tp * p * p).contiguous(), (t, h, w)


class MultiModalProcessor:
    """Preprocesses a prompt's images for a multimodal checkpoint.

    Args:
        model_dir: the checkpoint (its `preprocessor_config.json`, when present, sets the
            image processor's fields; otherwise the vision config's patch sizes and Qwen3.5's
            mean / std of 0.5).
        mm: the checkpoint's `MultiModalConfig`.
        limit_per_prompt: most items per prompt by modality ({"image": N, "video": M});
            vLLM's `limit_mm_per_prompt` (defaults: 16 images, 1 video).
        max_image_pixels: most pixels (width x height) of an input image or video frame.

    Raises:
        ValueError: an unreadable `preprocessor_config.json` or `video_preprocessor_config.json`.
    """

    def __init__(self, model_dir: str, mm: MultiModalConfig, limit_per_prompt: dict[str, int] | None = None,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.mm = mm
        self.limit_per_prompt = {"image": DEFAULT_IMAGES_PER_PROMPT, "video": DEFAULT_VIDEOS_PER_PROMPT,
                                 **(limit_per_prompt or {})}
        self.max_image_pixels = max_image_pixels
        fields: dict[str, Any] = {"patch_size": mm.patch_size, "temporal_patch_size": mm.temporal_patch_size,
                                  "merge_size": mm.spatial_merge_size, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
        path = os.path.join(model_dir, "preprocessor_config.json")
        fields.update({k: v for k, v in _read_json(path).items() if k in _PREPROCESSOR_KEYS})
        self.image_processor = Qwen2VLImageProcessorPil(**fields)
        video = {**_VIDEO_DEFAULTS, **_read_json(os.path.join(model_dir, "video_preprocessor_config.json"))}
        size = video["size"]
        self.video_min_pixels = int(size.get("shortest_edge", video.get("min_pixels", 0)))
        self.video_max_pixels = int(size.get("longest_edge", video.get("max_pixels", 0)))
        self.video_mean, self.video_std = video["image_mean"], video["image_std"]
        self.video_rescale_factor = float(video["rescale_factor"])
        self.video_temporal_patch_size = int(video.get("temporal_patch_size", mm.temporal_patch_size))
        if self.image_processor.merge_size != mm.spatial_merge_size or self.image_processor.patch_size != mm.patch_size:
            raise ValueError(f"{path}: patch_size / merge_size ({self.image_processor.patch_size}, "
                             f"{self.image_processor.merge_size}) differ from the vision config's "
                             f"({mm.patch_size}, {mm.spatial_merge_size})")

    def check_image(self, image: Any, where: str) -> None:
        """Refuse what is not an image or is too large, before its pixels are decoded.

        Raises:
            ValueError: not a PIL image, more than `max_image_pixels` pixels, or an aspect
                ratio over 200 (HF's `smart_resize` limit); the message starts with `where`
                (which image).
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
        if max(w, h) / min(w, h) > MAX_ASPECT_RATIO:
            raise ValueError(f"{where} is {w} x {h} pixels: its aspect ratio is over {MAX_ASPECT_RATIO}, the most the "
                             "image processor takes; crop or pad it")

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

    def _preprocess_video(self, video: Any, where: str) -> tuple[torch.Tensor, tuple[int, int, int], list[float]]:
        """(pixel rows [t*h*w, C*tp*p*p] float32, grid (t, h, w), seconds of each frame group)
        of one video: frames [T, H, W, 3] uint8 (an array or a list of PIL images), or
        (frames, metadata) with metadata {"fps": float, "frames_indices": [...]} (vLLM's form)."""
        from PIL import Image
        from transformers.image_processing_backends import PilBackend
        from transformers.image_utils import SizeDict
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        meta: dict = {}
        if isinstance(video, tuple):
            if len(video) != 2 or not isinstance(video[1], dict):
                raise ValueError(f"{where} must be frames or (frames, metadata dict)")
            video, meta = video
        if isinstance(video, (list, tuple)) and video and all(isinstance(f, Image.Image) for f in video):
            frames = np.stack([np.asarray(f.convert("RGB")) for f in video])
        elif isinstance(video, np.ndarray):
            frames = video
        else:
            raise ValueError(f"{where} must be a uint8 array [frames, height, width, 3] or a list of PIL images, "
                             f"got {type(video).__name__}")
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(f"{where} must be a uint8 array [frames, height, width, 3]; got {frames.dtype} "
                             f"{list(frames.shape)}")
        num, height, width = frames.shape[:3]
        tp = self.video_temporal_patch_size
        if not tp <= num <= MAX_VIDEO_FRAMES:
            raise ValueError(f"{where} has {num} frames; give {tp} to {MAX_VIDEO_FRAMES}")
        if height * width > self.max_image_pixels:
            raise ValueError(f"{where}'s frames are {width} x {height} = {width * height} pixels, over the limit of "
                             f"{self.max_image_pixels}; send smaller frames")
        fps = meta.get("fps") or DEFAULT_VIDEO_FPS
        indices = meta.get("frames_indices") or list(range(num))
        if not isinstance(fps, (int, float)) or fps <= 0 or len(indices) != num:
            raise ValueError(f"{where}: metadata needs fps > 0 and one frames_indices entry per frame")
        ip = self.image_processor
        factor = ip.patch_size * ip.merge_size
        try:
            rh, rw = smart_resize(num, height, width, temporal_factor=tp, factor=factor,
                                  min_pixels=self.video_min_pixels, max_pixels=self.video_max_pixels)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        out = []
        for frame in frames:  # [H, W, 3] -> [3, rh, rw] float32, as the image path's Pillow operations
            x = PilBackend.resize(ip, np.ascontiguousarray(frame.transpose(2, 0, 1)), SizeDict(height=rh, width=rw),
                                  resample=ip.resample)
            x = ip.normalize(ip.rescale(x, self.video_rescale_factor), self.video_mean, self.video_std)
            out.append(torch.from_numpy(np.asarray(x, dtype=np.float32)))
        clip = torch.stack(out)  # [T, 3, rh, rw]
        if pad := -num % tp:
            clip = torch.cat([clip, clip[-1:].expand(pad, -1, -1, -1)])
        pixels, grid = patchify_video(clip, ip.patch_size, ip.merge_size, tp)
        return pixels, grid, video_timestamps(indices, float(fps), tp)

    def process(self, token_ids: Sequence[int], data: Any, tokenizer: "PreTrainedTokenizerBase"
                ) -> tuple[list[int], MultiModalInputs | None]:
        """Expand the image and video placeholders of `token_ids` for the items in `data`
        (vLLM's `multi_modal_data`: {"image": PIL image or list, "video": frames or list};
        see `_preprocess_video` for a video's forms). `tokenizer` encodes the videos'
        timestamps. Returns the expanded ids and the inputs (None when `data` has no items).

        Raises:
            ValueError: `data` is not a dict, names an unsupported modality, has more items
                than `limit_per_prompt`, an image or video is malformed, too large or
                corrupt, or the number of `<|image_pad|>` / `<|video_pad|>` placeholders in
                the prompt differs from the number of images / videos.
        """
        if not isinstance(data, dict):
            raise ValueError(f"multi_modal_data must be a dict like {{'image': [...]}}, got {type(data).__name__}")
        unknown = sorted(set(data) - {"image", "video"})
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modality {unknown[0]!r}; supported: 'image', 'video'")
        mm = self.mm
        given = {"image": _as_items(data.get("image", [])), "video": _as_items(data.get("video", []))}
        if any(x is None for items in given.values() for x in items):
            raise ValueError("multi_modal_data: an item is None")
        pad_ids = {"image": mm.image_token_id, "video": mm.video_token_id}
        for kind, items in given.items():
            limit = self.limit_per_prompt[kind]
            if len(items) > limit:
                raise ValueError(f"the prompt has {len(items)} {kind}s, over the limit of {limit} per prompt "
                                 "(limit_mm_per_prompt)")
            num_placeholders = sum(1 for t in token_ids if t == pad_ids[kind])
            if num_placeholders != len(items):
                raise ValueError(
                    f"the prompt has {num_placeholders} {kind} placeholders (token {pad_ids[kind]}, "
                    f"'<|{kind}_pad|>' inside <|vision_start|> ... <|vision_end|>) but {len(items)} {kind}s were "
                    f"given; put one placeholder per {kind}, as the chat template does")
        if not given["image"] and not given["video"]:
            return list(token_ids), None
        images = iter([self._preprocess(im, f"image {i + 1}") for i, im in enumerate(given["image"])])
        videos = iter([self._preprocess_video(v, f"video {i + 1}") for i, v in enumerate(given["video"])])
        merge = mm.spatial_merge_size ** 2
        ids: list[int] = []
        items: list[MultiModalItem] = []
        for t in token_ids:
            if t == mm.image_token_id:
                pixels, grid = next(images)
                n = grid[0] * grid[1] * grid[2] // merge
                items.append(MultiModalItem("image", len(ids), n, grid, pixels, _digest("image", grid, pixels)))
                ids.extend([t] * n)
            elif t == mm.video_token_id:
                pixels, (gt, gh, gw), seconds = next(videos)
                rows = gh * gw  # pixel rows of one frame group
                for g in range(gt):
                    ids.extend(tokenizer.encode(f"<{seconds[g]:.1f} seconds>", add_special_tokens=False))
                    ids.append(mm.vision_start_token_id)
                    part = pixels[g * rows:(g + 1) * rows]
                    items.append(MultiModalItem("video", len(ids), rows // merge, (1, gh, gw), part,
                                                _digest("video", (1, gh, gw), part)))
                    ids.extend([t] * (rows // merge))
                    ids.append(mm.vision_end_token_id)
            else:
                ids.append(t)
        positions, delta = mrope_positions(len(ids), [(x.offset, x.grid_thw) for x in items], mm.spatial_merge_size)
        return ids, MultiModalInputs(tuple(items), positions, delta)
