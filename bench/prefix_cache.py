"""Prefix caching on and off: TTFT and hit rate on three workloads.

- `shared`: a 1,024-token system prompt followed by 32 distinct 32-token questions, at most
  4 in flight;
- `chat`: an 8-turn chat, each turn re-sending the whole history plus a 32-token message;
- `suffix`: a 256-token prefix repeated with 8 different 512-token suffixes, one at a time.

Each (checkpoint, caching on/off) runs in its own process (float32, 1 torch thread), on
random token ids, 16 greedy output tokens per request (`ignore_eos`).

    python bench/prefix_cache.py --checkpoint small --out bench/results/prefix_cache

`--checkpoint` takes a directory or a preset of bench/make_checkpoint.py. Writes OUT.json,
OUT.md and OUT.png. Hybrid models are reported with caching off in the engine (not yet
supported for them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # bench/ siblings, also when imported

from report import pyplot, write_markdown  # noqa: E402
NEW_TOKENS = 16


def workloads(seed: int = 0) -> dict[str, list[list[int]]]:
    """Prompts of the `shared` and `suffix` workloads (the `chat` one depends on outputs)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, 30000) for _ in range(n)]

    system = toks(1024)
    prefix = toks(256)
    return {"shared": [system + toks(32) for _ in range(32)], "suffix": [prefix + toks(512) for _ in range(8)],
            "chat_messages": [toks(32) for _ in range(8)]}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def run_worker(spec: dict) -> dict:
    """(subprocess) Run the three workloads on one engine; returns TTFTs and cache figures."""
    import torch

    from moestream import LLM, SamplingParams

    torch.set_num_threads(spec["threads"])
    llm = LLM(spec["checkpoint"], dtype="float32", max_model_len=4096, enable_prefix_caching=spec["caching"])
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    w = workloads()
    out: dict = {"prefix_caching": llm.prefix_cache_stats()["enabled"]}

    def serve(prompts: list[list[int]], in_flight: int) -> tuple[list[float], list[int], list[list[int]]]:
        ttft, cached, outputs, pending, active, i = [], [], {}, list(range(len(prompts))), set(), 0
        while pending or active:
            while pending and len(active) < in_flight:
                k = pending.pop(0)
                active.add(engine.add_request({"prompt_token_ids": prompts[k]}, params, request_id=f"{i}-{k}"))
                i += 1
            for o in engine.step():
                if o.finished:
                    active.discard(o.request_id)
                    k = int(o.request_id.split("-")[1])
                    outputs[k] = o
        for k in range(len(prompts)):
            o = outputs[k]
            ttft.append(o.metrics.first_token_time - o.metrics.arrival_time)
            cached.append(o.num_cached_tokens)
        return ttft, cached, [outputs[k].outputs[0].token_ids for k in range(len(prompts))]

    for name in ("shared", "chat", "suffix"):
        before = dict(llm.prefix_cache_stats())
        start = time.perf_counter()
        if name == "chat":
            ttft, cached, history = [], [], []
            for message in w["chat_messages"]:
                prompt = history + message
                t, c, o = serve([prompt], 1)
                ttft += t
                cached += c
                history = prompt + o[0]
        else:
            ttft, cached, _ = serve(w[name], 4 if name == "shared" else 1)
        after = llm.prefix_cache_stats()
        queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
        out[name] = {"ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "requests": len(ttft),
                     "cached_tokens": sum(cached), "hit_rate": hits / queries if queries else 0.0,
                     "wall_s": time.perf_counter() - start}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="small", help="directory or bench/make_checkpoint.py preset (default: small)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine (default: 1)")
    ap.add_argument("--out", default="bench/results/prefix_cache", help="output path prefix")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return 0
    from make_checkpoint import PRESETS, ensure_checkpoint

    ckpt = args.checkpoint
    if ckpt in PRESETS:
        ckpt = ensure_checkpoint(ckpt, os.path.join("/tmp/moestream-bench", ckpt))
    load = os.getloadavg()[0]
    results = {}
    for caching in (False, True):
        spec = {"checkpoint": ckpt, "caching": caching, "threads": args.threads}
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], cwd=ROOT, capture_output=True,
                              text=True, env=dict(os.environ, PYTHONPATH=ROOT))
        if proc.returncode != 0:
            raise RuntimeError(f"worker failed: {proc.stderr[-3000:]}")
        results["on" if caching else "off"] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"caching {'on' if caching else 'off'}: {results['on' if caching else 'off']}", flush=True)
    meta = {"checkpoint": os.path.basename(os.path.normpath(ckpt)), "threads": args.threads,
            "new_tokens": NEW_TOKENS, "load_before": round(load, 2), "busy": load > 0.5}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    lines = [f"# Prefix caching on `{meta['checkpoint']}` (float32, {args.threads} thread, {NEW_TOKENS} output tokens"
             f"{', machine busy' if meta['busy'] else ''})", "",
             "| workload | TTFT p50 off (s) | TTFT p50 on (s) | on/off | TTFT p99 off (s) | TTFT p99 on (s) | "
             "hit rate on | cached tokens on |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("shared", "chat", "suffix"):
        off, on = results["off"][name], results["on"][name]
        lines.append(f"| {name} | {off['ttft_p50_s']:.3f} | {on['ttft_p50_s']:.3f} | "
                     f"{on['ttft_p50_s'] / off['ttft_p50_s']:.2f}x | {off['ttft_p99_s']:.3f} | {on['ttft_p99_s']:.3f} | "
                     f"{on['hit_rate']:.1%} | {on['cached_tokens']} |")
    if not results["on"]["prefix_caching"]:
        lines += ["", "Prefix caching is not yet available for this (hybrid) model: 'on' ran without it."]
    write_markdown(args.out + ".md", lines)
    plt = pyplot()
    if plt is None:
        return 0
    names = ["shared", "chat", "suffix"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [results["off"][n]["ttft_p50_s"] for n in names], 0.4, label="prefix caching off")
    ax.bar([x + 0.2 for x in xs], [results["on"][n]["ttft_p50_s"] for n in names], 0.4, label="prefix caching on")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title(f"Prefix caching, {meta['checkpoint']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
