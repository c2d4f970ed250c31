"""`MultiModalItem` and `MultiModalInputs`: a prompt's processed images, as the engine keeps them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class MultiModalItem:
    """One image, or one frame group of a video (`temporal_patch_size` frames), of a prompt,
    preprocessed; its placeholder tokens are contiguous.

    Attributes:
        modality: "image" or "video".
        offset: index in the prompt's token ids of its first placeholder token.
        length: its placeholder tokens, one per vision embedding: t * h * w / merge**2.
        grid_thw: (t, h, w) patches (HF's `image_grid_thw` row).
        pixel_values: [t * h * w, C * temporal_patch * patch * patch] float32, HF's
            `pixel_values` rows of this image.
        hash: sha256 of the modality, grid and pixel values (32 bytes): equal images, equal
            hashes; it enters the prefix-cache hash of every block its tokens fall in.
            (A video's timestamps are text tokens, hashed as such.)
    """

    modality: str
    offset: int
    length: int
    grid_thw: tuple[int, int, int]
    pixel_values: torch.Tensor
    hash: bytes

    @property
    def end(self) -> int:
        """Index one past its last placeholder token."""
        return self.offset + self.length


@dataclass(frozen=True, eq=False)
class MultiModalInputs:
    """A multimodal prompt's images / video frame groups and positions.

    Attributes:
        items: its images and video frame groups in prompt order (placeholders already expanded).
        mrope_positions: [3, P] int64 (CPU): temporal, height, width position of each
            prompt token (HF `get_rope_index`).
        mrope_delta: max position + 1 - P; token p >= P (output, drafts) sits at position
            p + mrope_delta on all three axes (HF's `rope_deltas`).
    """

    items: tuple[MultiModalItem, ...]
    mrope_positions: torch.Tensor
    mrope_delta: int

    @property
    def hash_spans(self) -> tuple[tuple[int, int, bytes], ...]:
        """(first token, end token, content hash) of each item, for the block hashes."""
        return tuple((it.offset, it.end, it.hash) for it in self.items)
