"""lm-evaluation-harness on the built-in demo models: the local tasks in bench/eval
(`stdlib_mc`, 10 multiple-choice items scored by log-likelihood; `stdlib_gen`, 5 greedy
line completions scored by exact match) through `moestream serve` (lm-eval's
`local-completions`, unmodified), at full residency and at a 25% expert budget, and
through HF transformers (lm-eval's `hf` model) as the reference. Each server and each lm-eval
run is its own process.

Writes bench/results/lm_eval_demos.{json,md,png}: per model and engine, accuracy, exact
match, the largest per-choice log-likelihood difference from HF's, and whether every
generation equals HF's.

    python bench/lm_eval_demos.py [--models demo demo-hybrid] [--out bench/results/lm_eval_demos]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from report import pyplot, write_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ("stdlib_mc", "stdlib_gen")
# (engine label, extra `moestream serve` flags); None: lm-eval's own `hf` model
ENGINES: tuple[tuple[str, list[str] | None], ...] = (
    ("hf", None),
    ("moestream", []),
    ("moestream, 25% experts", ["--expert-budget", "0.25"]),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    """Wait for GET /health to answer 200.

    Raises:
        RuntimeError: the server exited or did not answer within `timeout_s` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moestream serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("moestream serve did not become healthy")


def run_lm_eval(model: str, model_args: str, out: str) -> dict:
    """One lm-eval run of TASKS from the repository root; returns {task: samples}, plus "results"."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", *TASKS,
           "--include_path", "bench/eval", "--output_path", out, "--log_samples", "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"lm-eval failed: {proc.stderr[-3000:]}")
    found: dict = {"results": json.load(open(glob.glob(os.path.join(out, "*", "results_*.json"))[0]))["results"]}
    for task in TASKS:
        (path,) = glob.glob(os.path.join(out, "*", f"samples_{task}_*.jsonl"))
        found[task] = sorted((json.loads(line) for line in open(path)), key=lambda s: s["doc_id"])
    return found


def evaluate(model: str, flags: list[str] | None, work: str) -> dict:
    """lm-eval of `model` (a built-in name) through HF (flags None) or a `moestream serve` with `flags`."""
    out = tempfile.mkdtemp(dir=work)
    if flags is None:
        from moestream.demo import builtin_model_path

        return run_lm_eval("hf", f"pretrained={builtin_model_path(model)},dtype=float32", out)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "moestream.server.cli", "serve", "--model", model, "--dtype", "float32",
           "--port", str(port), "--enable-tokenizer-info-endpoint", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc)
        return run_lm_eval("local-completions", f"base_url={url}/v1/completions,model={model}", out)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["demo", "demo-hybrid"], help="built-in models")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "lm_eval_demos"),
                    help="output path without extension (.json, .md, .png are written)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for model in args.models:
            runs = {label: evaluate(model, flags, work) for label, flags in ENGINES}
            hf = runs["hf"]
            for label, run in runs.items():
                diffs = [abs(float(a[0][0]) - float(b[0][0])) for s, h in zip(run["stdlib_mc"], hf["stdlib_mc"])
                         for a, b in zip(s["resps"], h["resps"])]
                rows.append({
                    "model": model, "engine": label,
                    "stdlib_mc_acc": run["results"]["stdlib_mc"]["acc,none"],
                    "stdlib_gen_exact_match": run["results"]["stdlib_gen"]["exact_match,none"],
                    "max_loglikelihood_diff_vs_hf": max(diffs),
                    "generations_equal_hf": [s["resps"] for s in run["stdlib_gen"]] ==
                                            [s["resps"] for s in hf["stdlib_gen"]],
                })
    with open(args.out + ".json", "w") as f:
        json.dump({"tasks": TASKS, "rows": rows}, f, indent=1)
    lines = ["| model | engine | stdlib_mc acc | stdlib_gen exact match | max loglikelihood diff vs HF | "
             "generations = HF's |", "|---|---|---:|---:|---:|---|"]
    lines += [f"| {r['model']} | {r['engine']} | {r['stdlib_mc_acc']:.2f} | {r['stdlib_gen_exact_match']:.2f} | "
              f"{r['max_loglikelihood_diff_vs_hf']:.1e} | {'yes' if r['generations_equal_hf'] else 'no'} |" for r in rows]
    write_markdown(args.out + ".md", lines)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"{r['model']}\n{r['engine']}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["stdlib_mc_acc"] for r in rows], 0.4, label="stdlib_mc acc")
        ax.bar([i + 0.2 for i in x], [r["stdlib_gen_exact_match"] for r in rows], 0.4, label="stdlib_gen exact match")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        ax.set_title("lm-eval through moestream serve vs HF (float32)")
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)


if __name__ == "__main__":
    main()
