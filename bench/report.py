"""Shared parts of the bench scripts: the checkpoint a name stands for, waiting for an idle
machine, the markdown table file and matplotlib's pyplot."""

from __future__ import annotations

import os
import sys
import time
from types import ModuleType


def resolve_checkpoint(name: str) -> str:
    """A checkpoint directory for `name`: a preset of make_checkpoint.py (made once under
    /tmp/moestream-bench/), or `name` itself."""
    from make_checkpoint import PRESETS, ensure_checkpoint

    if name in PRESETS:
        return ensure_checkpoint(name, os.path.join("/tmp/moestream-bench", name))
    return name


def wait_for_idle(max_wait_s: float = 180.0, threshold: float = 0.5) -> float:
    """Wait (at most `max_wait_s` seconds) until the 1-minute load average is at most
    `threshold`, so an earlier job's load fades; returns the load average then."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] > threshold and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def write_markdown(path: str, lines: list[str]) -> None:
    """Write `lines` to `path` (one per line) and print them."""
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on the Agg backend, or None (said on stderr) when matplotlib is not
    installed: the JSON and markdown results do not need it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot", file=sys.stderr)
        return None
    return plt
