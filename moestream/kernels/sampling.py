"""Greedy sampling's row-wise argmax on CPU (`sampling_cpu.cpp`,
`torch.ops.moestream_cpu.argmax_rows`): torch's `max(dim=-1)` took 12.5 ms a step for 64 rows
of a 152k vocabulary on one thread; this reads each row twice with SIMD instead. Built with
the other CPU kernels (`kernels/build.py`)."""

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
