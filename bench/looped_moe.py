"""Looped MoE routing and paging: how often a pass re-selects the experts of the pass before
(per stack layer), and misses per token under expert budgets for the default policy
(`next_use`; and its variant told the pass count), LRU and Belady's optimum, replayed from a routing trace recorded by moestream
on held-out text (the standard library files the demos hold out).

Writes OUT.json, OUT.md and OUT.png.

    python bench/looped_moe.py [--checkpoint demo-looped] [--prompts 24] [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from typing import TYPE_CHECKING

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from report import pyplot, write_markdown  # noqa: E402

if TYPE_CHECKING:
    from moestream.experts.trace import RoutingTrace

BUDGETS = (0.10, 0.25, 0.50)
POLICIES = ("next_use", "next_use_passes", "lru", "belady")


def heldout_texts(n: int) -> list[str]:
    """The first `n` held-out standard-library files (the demos' split), sorted by path."""
    import sysconfig

    from train_demo_model import is_heldout, read, stdlib_files

    base = sysconfig.get_paths()["stdlib"]
    return [read(f) for f in stdlib_files() if is_heldout(f, base)][:n]


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="demo-looped", help="a loop-moe checkpoint directory or 'demo-looped'")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=256, help="prompt tokens each (default: 256)")
    ap.add_argument("--out", default="bench/results/looped_moe", help="output path prefix")
    args = ap.parse_args(argv)
    from moestream.demo import resolve_model
    from moestream.experts.policy import make_policy
    from moestream.experts.trace import RoutingTrace
    from moestream.experts.trace_sim import BeladyPolicy, future_of, simulate

    ckpt = resolve_model(args.checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "routing.npz")
        L, R, E = record(ckpt, args.prompts, args.tokens, path)
        trace = RoutingTrace.load(path)
    k = len(trace[0][1])
    tokens = len(trace) // (L * R)
    again = reselection(trace, L, R, k)
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
    meta = {"checkpoint": args.checkpoint, "L": L, "R": R, "experts": E, "top_k": k, "tokens": tokens,
            "prompts": args.prompts, "random_reselection": k / E}
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "reselection_per_layer": again, "rows": rows}, f, indent=1)
    lines = [f"`{args.checkpoint}`: L={L}, R={R}, {E} experts top-{k} per stack layer; {tokens} tokens of "
             f"{args.prompts} held-out prompts", "",
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
    write_markdown(args.out + ".md", lines)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for name in POLICIES:
            ax.plot([r["budget"] * 100 for r in rows], [r[name]["misses_per_token"] for r in rows], "o-", label=name)
        ax.set(xlabel="expert budget (% of stack experts)", ylabel="misses per token",
               title=f"looped MoE paging ({args.checkpoint})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
