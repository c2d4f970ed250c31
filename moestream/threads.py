"""How many torch intra-op threads an engine runs with: `--threads N|auto`.

'auto' is the cores this process may really use: its CPU affinity, capped by its
container's CPU quota (cgroup v2 `cpu.max`, else cgroup v1 `cpu.cfs_quota_us` /
`cpu.cfs_period_us`), less any reserved for other work in the process (`moestream serve`
keeps one for its HTTP event loop), and fewer when the machine's 1-minute load average
leaves fewer cores free than that (logged), at least 1; on an accelerator, torch's own
default. Measured on an idle 2-core machine
(`bench/results/throughput_small_executor_float32_2threads.md` against the 1-thread run of
the same session): 2 threads decoded 1.3-1.6x faster than 1 at c1, c16 and c64, so the
offline `LLM` and `moestream generate` use every free core. On shared cores
oversubscription costs far more (docs/performance.md, finding 1: 8-20x slower): give a
number there; `slow_step_hint` words the advice when a run's decode rate collapsed.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from moestream.config.engine import MAX_THREADS  # declared with the threads option
from moestream.host_memory import read_sys_text

logger = logging.getLogger(__name__)

CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
"""The cgroup v2 CPU quota of a container's own cgroup: "QUOTA PERIOD" (microseconds) or "max PERIOD"."""

CGROUP_V1_CPU_DIR = "/sys/fs/cgroup/cpu"
"""The cgroup v1 CPU controller directory: `cpu.cfs_quota_us` (-1: no limit) and `cpu.cfs_period_us`."""

COLLAPSE_RATIO = 4.0
"""`slow_step_hint`: a decode rate this many times below the best rate seen counts as collapsed.
Oversubscribed OpenMP threads on shared cores ran 8-20x slower (docs/performance.md, finding 1);
ordinary batch and cache effects stay well within 2x."""


def _quota_cpus(quota: int, period: int) -> int:
    """CPUs a CFS quota allows: quota / period (both microseconds) rounded up, at least 1."""
    return max(1, -(-quota // period))


def cgroup_cpu_limit(cpu_max_path: str = CGROUP_V2_CPU_MAX, cgroup_v1_dir: str = CGROUP_V1_CPU_DIR) -> int | None:
    """The CPUs this process's cgroup quota allows, rounded up (at least 1), or None when there
    is no quota: the cgroup v2 file `cpu_max_path` ("200000 100000": 2 CPUs; "max 100000": no
    limit), else the cgroup v1 files `cpu.cfs_quota_us` (-1: no limit) and `cpu.cfs_period_us`
    (microseconds) in `cgroup_v1_dir`. Missing files mean no quota. A file that cannot be
    parsed is logged (warning) and ignored: it never fails a start-up."""
    text = read_sys_text(cpu_max_path)
    if text is not None:
        parts = text.split()
        if len(parts) == 2 and parts[0] == "max" and parts[1].isdigit():
            return None
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit() and int(parts[1]) > 0:
            return _quota_cpus(int(parts[0]), int(parts[1]))
        logger.warning("ignoring the CPU quota in %s: expected 'QUOTA PERIOD' or 'max PERIOD', got %r",
                       cpu_max_path, text[:80])
        return None
    quota, period = (read_sys_text(os.path.join(cgroup_v1_dir, name))
                     for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
    if quota is None or period is None:
        return None
    try:
        q, p = int(quota), int(period)
    except ValueError:
        logger.warning("ignoring the CPU quota in %s: cpu.cfs_quota_us %r and cpu.cfs_period_us %r are not integers",
                       cgroup_v1_dir, quota[:40], period[:40])
        return None
    return _quota_cpus(q, p) if q > 0 and p > 0 else None


def available_cores(cpu_max_path: str = CGROUP_V2_CPU_MAX, cgroup_v1_dir: str = CGROUP_V1_CPU_DIR) -> int:
    """Cores this process may run on: its affinity mask where the OS has one (else the CPU
    count), capped by its cgroup CPU quota (`cgroup_cpu_limit`; the paths are for tests)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_limit(cpu_max_path, cgroup_v1_dir)
    return cores if quota is None else min(cores, quota)


def free_cores(load: float, cpu_count: int) -> int:
    """Cores of a `cpu_count`-CPU machine that a 1-minute load average of `load` (runnable
    tasks) leaves free, to the nearest core (a core busy half the time or more is not
    free), at least 0."""
    return max(0, math.floor(cpu_count - load + 0.5))


def resolve_threads(value: int | str | None, device: str, reserve: int = 0, *,
                    load: float | None = None, cpu_max_path: str = CGROUP_V2_CPU_MAX,
                    cgroup_v1_dir: str = CGROUP_V1_CPU_DIR) -> int | None:
    """The torch thread count for `value`: an int as given; None leaves torch's setting;
    'auto' is None on an accelerator, and on CPU `available_cores() - reserve` (at least 1),
    lowered to `free_cores(load, os.cpu_count()) - reserve` (at least 1) when the machine's
    load leaves fewer cores free than that; the fallback is logged (info) with the load
    and the counts.

    Args:
        load: the machine's 1-minute load average (runnable tasks); None reads
            `os.getloadavg()` (no load where the OS has none). Note that it counts this
            process's own recent work too.
        cpu_max_path, cgroup_v1_dir: where the cgroup CPU quota is read (`cgroup_cpu_limit`).

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
                             f"{available_cores(cpu_max_path, cgroup_v1_dir)} core(s): give at most that, or 'auto'")
        return value
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}") from None
    if kind != "cpu":
        return None
    cores = available_cores(cpu_max_path, cgroup_v1_dir)
    threads = max(1, cores - reserve)
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average on this OS
            load = 0.0
    cpu_count = os.cpu_count() or cores
    free = free_cores(load, cpu_count)
    if free - reserve < threads and threads > 1:
        fallback = max(1, free - reserve)
        logger.info("threads auto: the 1-minute load average %.2f leaves %d of this machine's %d CPUs free; "
                    "using %d torch thread(s) instead of %d (%d usable core(s)%s); give --threads N to choose",
                    load, free, cpu_count, fallback, threads, cores, f", {reserve} reserved" if reserve else "")
        return fallback
    return threads


def slow_step_hint(tokens_per_s: float, threads: int, best_tokens_per_s: float, *,
                   ratio: float = COLLAPSE_RATIO) -> str | None:
    """A one-line hint when decoding collapsed on more than one thread, else None.

    Collapsed: `tokens_per_s` is more than `ratio` times below `best_tokens_per_s`, the best
    rate seen in the same run (e.g. over a window of steps), as when OpenMP threads wait on
    a core another process holds. With one thread there is nothing to lower: None.

    Args:
        tokens_per_s: the measured decode rate (tokens per second), >= 0.
        threads: the torch thread count it ran with, >= 1.
        best_tokens_per_s: the best rate seen so far in the run (tokens per second), >= 0
            (0: none yet, no hint).
        ratio: how many times slower than the best counts as collapsed, > 1.

    Raises:
        ValueError: a rate is negative or not finite, `threads` is below 1, or `ratio` is
            not above 1.
    """
    if not (math.isfinite(tokens_per_s) and tokens_per_s >= 0 and math.isfinite(best_tokens_per_s)
            and best_tokens_per_s >= 0):
        raise ValueError(f"rates must be finite and >= 0 tokens/s, got {tokens_per_s!r} and {best_tokens_per_s!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    if not ratio > 1:
        raise ValueError(f"ratio must be above 1, got {ratio!r}")
    if threads == 1 or tokens_per_s * ratio >= best_tokens_per_s:
        return None
    return (f"decoding at {tokens_per_s:.1f} tok/s on {threads} threads, down from {best_tokens_per_s:.1f} tok/s "
            "earlier in this run: if the cores are shared, try --threads 1")
