"""How many torch intra-op threads an engine runs with: `--threads N|auto`.

'auto' is the cores this process may run on (its CPU affinity), less any reserved for
other work in the process (`moestream serve` keeps one for its HTTP event loop), at least
1; on an accelerator, torch's own default. Measured on an idle 2-core machine
(`bench/results/throughput_small_executor_float32_2threads.md` against the 1-thread run of
the same session): 2 threads decoded 1.3-1.6x faster than 1 at c1, c16 and c64, so the
offline `LLM` and `moestream generate` use every core. On shared cores oversubscription
costs far more (docs/performance.md, finding 1): give a number there.
"""

from __future__ import annotations

import os

import torch

MAX_THREADS = 1024
"""Upper bound of an explicit thread count: torch's OpenMP pool crashes (SIGSEGV) when asked
for ~10**5 threads and overflows at 2**31, and no CPU this engine runs on has more cores."""


def available_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def resolve_threads(value: int | str | None, device: str, reserve: int = 0) -> int | None:
    """The torch thread count for `value`: an int as given; None leaves torch's setting;
    'auto' is, on CPU, `available_cores() - reserve` (at least 1), and None on an accelerator.

    Raises:
        ValueError: `value` is not a positive int up to `MAX_THREADS`, 'auto' or None, or
            `device` is not a torch device.
    """
    if value is None:
        return None
    if value != "auto":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"threads must be a positive integer or 'auto', got {value!r}")
        if value > MAX_THREADS:
            raise ValueError(f"threads={value} is more than {MAX_THREADS}; this process may run on "
                             f"{available_cores()} core(s): give at most that, or 'auto'")
        return value
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}") from None
    return max(1, available_cores() - reserve) if kind == "cpu" else None
