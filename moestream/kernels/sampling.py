"""Sampling kernels on CPU (`sampling_cpu.cpp`), built with the other CPU kernels
(`kernels/build.py`): greedy sampling's row-wise argmax (`torch.ops.moestream_cpu.argmax_rows`;
torch's `max(dim=-1)` took 12.5 ms a step for 64 rows of a 152k vocabulary on one thread, this
reads each row twice with SIMD), and structured outputs' token bitmask
(`torch.ops.moestream_cpu.apply_token_bitmask`; unpacking it in torch and `masked_fill_` took
8 ms a step for 16 rows of a 152k vocabulary)."""

from __future__ import annotations

import torch

from moestream.kernels.build import load_cpu_kernels


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 -> [B] int64: each row's first maximum, as `torch.argmax`
    (a row holding a NaN: torch's answer for it, the NaN's index).

    Raises:
        RuntimeError: not float32 [B, V] with contiguous rows, or kernels that did not build.
    """
    if not load_cpu_kernels():
        raise RuntimeError("the CPU kernels did not build (see the warning logged); use torch.argmax")
    ids = torch.ops.moestream_cpu.argmax_rows(logits)
    bad = ids < 0
    if bool(bad.any()):
        ids[bad] = logits[bad].argmax(dim=-1)
    return ids


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, vocab: int) -> None:
    """Set to -inf, in place, the logits of row rows[i] whose bit in bitmask[i] is 0 (bit j of
    int32 word w is token 32 w + j, llguidance's layout), and every logit at or past `vocab`.

    logits: [B, V] float32; bitmask: [R, W] int32; rows: [R] int64; vocab: tokens the bitmask
    covers (<= V, <= 32 W).

    Raises:
        RuntimeError: shapes or dtypes not as above, a row outside [0, B), or kernels that
            did not build.
    """
    if not load_cpu_kernels():
        raise RuntimeError("the CPU kernels did not build (see the warning logged)")
    torch.ops.moestream_cpu.apply_token_bitmask(logits, bitmask, rows, vocab)
