"""Looped MoE routing, paging and decode speed.

- Routing: how often a pass re-selects the experts of the pass before (per stack layer).
- Paging: misses per token under expert budgets for the default policy (`next_use`; and its
  variant told the pass count), LRU and Belady's optimum, replayed from a routing trace
  recorded by moestream on held-out text (the standard library files the demos hold out).
- Decode: greedy tokens per second of moestream (KV cache per (layer, pass)) against the
  reference's cache-free generation, which recomputes the whole prefix for every token
  (`tests/loop_moe_reference.py`, a float32 re-implementation of the reference's forward:
  the reference itself is research code, not a package). Each engine runs in its own
  process, one after the other, with the same threads; the tokens are compared too.

`--checkpoint` is `demo-looped`, the random `looped-medium` preset (L=4, R=4, 64 experts
top-4, d_model 512, per-pass attention, one head and one tail layer; made once under
/tmp/moestream-bench/) or a loop-moe checkpoint directory. Writes OUT.json, OUT.md and OUT.png.

    python bench/looped_moe.py [--checkpoint demo-looped] [--prompts 24] [--tokens 256] [--decode 64 512]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from typing import TYPE_CHECKING

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from report import pyplot, wait_for_idle, write_markdown  # noqa: E402

if TYPE_CHECKING:
    from moestream.experts.trace import RoutingTrace

BUDGETS = (0.10, 0.25, 0.50)
POLICIES = ("next_use", "next_use_passes", "lru", "belady")
# the random looped-medium preset: Foil's dvf_a shape (L=4, R=4) with 64 experts top-4
LOOPED_MEDIUM = dict(d_model=512, num_heads=8, d_ff=1024, num_layers_in_stack=4, num_stacks=4, num_experts=64,
                     num_active=4, num_head_layers=1, num_tail_layers=1, per_pass_attention=True,
                     context_length=1024, width_ratio=4.0)
DECODE_PROMPT_TOKENS = 16


def resolve(name: str) -> str:
    """A checkpoint directory: the built-in `demo-looped`, the `looped-medium` preset (written
    once, seed 0, under /tmp/moestream-bench/looped-medium) or `name` itself."""
    from moestream.demo import resolve_model

    if name != "looped-medium":
        return str(resolve_model(name))
    out = "/tmp/moestream-bench/looped-medium"
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        from tiny_checkpoint import make_loop_moe_checkpoint

        print(f"making checkpoint 'looped-medium' in {out} ...", flush=True)
        make_loop_moe_checkpoint(out, seed=0, **LOOPED_MEDIUM)
    return out


def heldout_texts(n: int) -> list[str]:
    """The first `n` held-out standard-library files (the demos' split), sorted by path."""
    from moestream.demo import heldout_files

    out = []
    for path in heldout_files()[:n]:
        with open(path, encoding="utf-8", errors="replace") as f:
            out.append(f.read())
    return out


def record(checkpoint: str, prompts: int, tokens: int, path: str) -> tuple[int, int, int]:
    """Prefill `prompts` held-out texts of `tokens` tokens each (plus 16 greedy tokens) with
    routing recorded to `path`; returns (L, R, experts per stack layer)."""
    from moestream import LLM, SamplingParams

    llm = LLM(checkpoint, dtype="float32", max_model_len=tokens + 32, record_routing=path)
    tok = llm.get_tokenizer()
    ids = [tok.encode(t)[:tokens] for t in heldout_texts(prompts * 2)]
    ids = [p for p in ids if len(p) == tokens][:prompts]
    llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=16))
    llm.llm_engine.save_routing_trace()
    loop = llm.llm_engine.model_config.loop
    if loop is None:
        raise SystemExit(f"{checkpoint} is not a looped model (model_type loop-moe)")
    return loop.num_layers_in_stack, loop.num_stacks, llm.llm_engine.model_config.num_experts


def reselection(trace: "RoutingTrace", L: int, R: int, k: int) -> list[float]:
    """Per stack layer l: the mean fraction of pass r+1's top-k that pass r also chose."""
    per_layer: dict[int, list[float]] = {}
    rows = list(trace)
    for i in range(0, len(rows), L * R):  # one token: passes in order, layers ascending within each
        token = rows[i:i + L * R]
        for r in range(R - 1):
            for l in range(L):
                (layer, now), (_, nxt) = token[r * L + l], token[(r + 1) * L + l]
                per_layer.setdefault(layer, []).append(len(set(now) & set(nxt)) / k)
    return [float(np.mean(v)) for _, v in sorted(per_layer.items())]


def decode_worker(engine: str, model: str, prompt: list[int], tokens: int, threads: int) -> dict:
    """One engine's greedy decode of `tokens` tokens after `prompt` (run in its own process):
    {"seconds", "tok_per_s", "tokens": ids}. moestream is warmed up with one short request
    first; the reference needs no warm-up (no cache, no compiled state)."""
    import time

    import torch

    torch.set_num_threads(threads)
    if engine == "moestream":
        from moestream import LLM, SamplingParams

        llm = LLM(model, dtype="float32", max_model_len=len(prompt) + tokens + 8, threads=threads)
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        seconds = time.perf_counter() - t0
        ids = list(out[0].outputs[0].token_ids)
    else:
        from loop_moe_reference import LoopMoEReference

        ref = LoopMoEReference(model)
        with torch.inference_mode():
            t0 = time.perf_counter()
            ids, _ = ref.greedy(prompt, tokens)
            seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tok_per_s": tokens / seconds, "tokens": ids}


def decode(model: str, lengths: list[int], threads: int) -> list[dict]:
    """Per output length: each engine's decode in its own subprocess (moestream first), on the
    first held-out prompt's first DECODE_PROMPT_TOKENS tokens."""
    import subprocess

    from moestream.loader import load_tokenizer

    prompt = load_tokenizer(model).encode(heldout_texts(1)[0])[:DECODE_PROMPT_TOKENS]
    rows = []
    for n in lengths:
        row: dict = {"tokens": n, "load_before": wait_for_idle()}
        for engine in ("moestream", "reference"):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", engine, "--checkpoint", model,
                   "--decode", str(n), "--threads", str(threads), "--prompt", json.dumps(prompt)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{engine} decode failed:\n{proc.stderr[-3000:]}")
            row[engine] = json.loads(proc.stdout.strip().splitlines()[-1])
        a, b = row["moestream"].pop("tokens"), row["reference"].pop("tokens")
        row["equal_prefix"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        row["speedup"] = row["moestream"]["tok_per_s"] / row["reference"]["tok_per_s"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def paging(trace: "RoutingTrace", L: int, R: int, E: int) -> list[dict]:
    """Misses per budget and policy (slots shared by all stack layers)."""
    from moestream.experts.policy import make_policy
    from moestream.experts.trace_sim import BeladyPolicy, future_of, simulate

    k = len(trace[0][1])
    tokens = len(trace) // (L * R)
    rows = []
    for b in BUDGETS:
        cap = max(k, int(round(b * L * E)))
        row = {"budget": b, "slots": cap}
        for name in POLICIES:
            if name == "belady":
                policy = BeladyPolicy(future_of(trace))
            elif name == "next_use_passes":  # the variant told R (NextUsePolicy(passes=R))
                policy = make_policy("next_use", passes=R)
            else:
                policy = make_policy(name)
            res = simulate(trace, policy, cap)
            row[name] = {"misses": res.misses, "misses_per_token": res.misses / tokens, "hit_rate": res.hit_rate}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="demo-looped",
                    help="'demo-looped', 'looped-medium' or a loop-moe checkpoint directory")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=256, help="prompt tokens each, for the routing trace (default: 256)")
    ap.add_argument("--decode", type=int, nargs="*", default=[64, 512],
                    help="output lengths of the decode comparison (default: 64 512; none to skip it)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of both engines")
    ap.add_argument("--out", default=None, help="output path prefix (default: bench/results/looped_moe_CHECKPOINT)")
    ap.add_argument("--worker", choices=("moestream", "reference"), help=argparse.SUPPRESS)
    ap.add_argument("--prompt", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(decode_worker(args.worker, args.checkpoint, json.loads(args.prompt), args.decode[0],
                                       args.threads)))
        return 0
    from moestream.experts.trace import RoutingTrace

    name = os.path.basename(os.path.normpath(args.checkpoint))
    out = args.out or os.path.join(ROOT, "bench", "results", f"looped_moe_{name}")
    ckpt = resolve(args.checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "routing.npz")
        L, R, E = record(ckpt, args.prompts, args.tokens, path)
        trace = RoutingTrace.load(path)
    k = len(trace[0][1])
    tokens = len(trace) // (L * R)
    again = reselection(trace, L, R, k)
    rows = paging(trace, L, R, E)
    speed = decode(ckpt, args.decode, args.threads) if args.decode else []
    meta = {"checkpoint": args.checkpoint, "L": L, "R": R, "experts": E, "top_k": k, "tokens": tokens,
            "prompts": args.prompts, "random_reselection": k / E, "threads": args.threads,
            "cpu": _cpu_name()}
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "reselection_per_layer": again, "rows": rows, "decode": speed}, f, indent=1)
    lines = [f"`{args.checkpoint}`: L={L}, R={R}, {E} experts top-{k} per stack layer; {tokens} tokens of "
             f"{args.prompts} held-out prompts; {meta['cpu']}, {args.threads} threads", "",
             "How often pass r+1 re-selects an expert of pass r (fraction of its top-k; chance: "
             f"{k / E:.3f}):", "", "| stack layer | re-selected |", "|---:|---:|"]
    lines += [f"| {l} | {a:.3f} |" for l, a in enumerate(again)]
    lines += ["", "Misses per token (stack experts; slots shared by all layers):", "",
              "| budget | slots | next_use (default) | next_use told the passes | LRU | Belady | "
              "next_use / Belady | LRU / Belady |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        nu, nu1, lru, bel = (r[p]["misses"] for p in POLICIES)
        lines.append(f"| {r['budget']:.0%} | {r['slots']} | {nu / tokens:.3f} ({nu}) | {nu1 / tokens:.3f} ({nu1}) | "
                     f"{lru / tokens:.3f} ({lru}) | {bel / tokens:.3f} ({bel}) | {nu / max(bel, 1):.2f} | "
                     f"{lru / max(bel, 1):.2f} |")
    if speed:
        lines += ["", f"Greedy decode after a {DECODE_PROMPT_TOKENS}-token prompt, float32, one request "
                  "(load average before each pair in the last column):", "",
                  "| output tokens | moestream tok/s | reference (cache-free) tok/s | moestream / reference | "
                  "equal tokens | load |", "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['tokens']} | {r['moestream']['tok_per_s']:.1f} | {r['reference']['tok_per_s']:.2f} | "
                  f"{r['speedup']:.1f}x | {r['equal_prefix']}/{r['tokens']} | {r['load_before']:.2f} |" for r in speed]
    write_markdown(out + ".md", lines)
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2 if speed else 1, figsize=(10 if speed else 5.5, 3.4), squeeze=False)
        ax = axes[0][0]
        for p in POLICIES:
            ax.plot([r["budget"] * 100 for r in rows], [r[p]["misses_per_token"] for r in rows], "o-", label=p)
        ax.set(xlabel="expert budget (% of stack experts)", ylabel="misses per token",
               title=f"looped MoE paging ({args.checkpoint})")
        ax.legend(fontsize=8)
        if speed:
            ax = axes[0][1]
            x = np.arange(len(speed))
            ax.bar(x - 0.2, [r["moestream"]["tok_per_s"] for r in speed], 0.4, label="moestream")
            ax.bar(x + 0.2, [r["reference"]["tok_per_s"] for r in speed], 0.4, label="reference (cache-free)")
            ax.set_xticks(x, [str(r["tokens"]) for r in speed])
            ax.set(xlabel="output tokens", ylabel="decode tok/s", yscale="log", title="greedy decode, float32")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out + ".png", dpi=120)
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
