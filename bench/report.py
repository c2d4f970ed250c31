"""Shared output of the bench scripts: the markdown table file and matplotlib's pyplot."""

from __future__ import annotations

import sys
from types import ModuleType


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
