"""Hybrid prefix caching under a tight state-checkpoint budget: hit rate against the
eviction rule's alpha (0 = LRU; larger weighs the tokens a checkpoint saves beyond its parent
more, as Marconi does) and its bonus for checkpoints hit before (0 or 1).

The workload interleaves, in a seeded random order, one request at a time:
- 4 system prompts (192 to 576 tokens) each followed by 12 distinct 24-token questions;
- 4 chats of 5 turns, each turn re-sending the whole history plus a 24-token message;
- 16 one-off 300-token prompts that share nothing.

It runs on a tiny random Qwen3-Next (hit rates depend on token patterns, not on weights), with
`--device-checkpoints` on the device and `--host-checkpoints` in host memory (default 4 + 4),
a checkpoint every 64 tokens, 8 greedy output tokens per request.

    python bench/checkpoint_eviction.py --out bench/results/checkpoint_eviction

Writes OUT.json, OUT.md and OUT.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from report import pyplot, write_markdown  # noqa: E402

ALPHAS = (0.0, 1.0, 2.0, 4.0, 8.0)
BONUSES = (0.0, 1.0)
NEW_TOKENS = 8


def workload(seed: int = 0, scale: float = 1.0) -> list[tuple[str, list[int]]]:
    """(kind, prompt ids, or a chat's next message ids) in arrival order; a chat turn's prompt
    is built as it runs (its history plus the message). `scale` multiplies the number of
    questions per system prompt, chats and one-off prompts (at least one of each)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, 30000) for _ in range(n)]

    items: list[tuple[str, list[int]]] = []
    for length in (192, 320, 448, 576):
        system = toks(length)
        items += [("shared", system + toks(24)) for _ in range(max(1, round(12 * scale)))]
    for chat in range(max(1, round(4 * scale))):
        items += [(f"chat{chat}", toks(24)) for _ in range(5)]
    items += [("unique", toks(300)) for _ in range(max(1, round(16 * scale)))]
    rng.shuffle(items)  # a chat's turns are its items in the order they come
    return items


def run(ckpt: str, alpha: float, bonus: float, device_ckpts: int, host_ckpts: int, scale: float = 1.0) -> dict:
    from moestream import LLM, SamplingParams

    probe = LLM(ckpt, dtype="float32", max_model_len=2048, enable_prefix_caching=False, threads=1)
    size = probe.llm_engine.state_pool.bytes_per_state
    del probe
    llm = LLM(ckpt, dtype="float32", max_model_len=2048, state_checkpoint_interval=64, threads=1,
              max_state_checkpoints=device_ckpts, state_checkpoint_host_bytes=host_ckpts * size)
    llm.llm_engine.coordinator.checkpoints.eviction_alpha = alpha
    llm.llm_engine.coordinator.checkpoints.hit_bonus = bonus
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    history: dict[str, list[int]] = {}
    per_kind: dict[str, list[int]] = {}
    start = time.perf_counter()
    for kind, ids in workload(scale=scale):
        prompt = history.get(kind, []) + ids if kind.startswith("chat") else ids
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        if kind.startswith("chat"):
            history[kind] = prompt + list(out.outputs[0].token_ids)
        group = "chat" if kind.startswith("chat") else kind
        stats = per_kind.setdefault(group, [0, 0])
        stats[0] += out.num_cached_tokens or 0
        stats[1] += len(prompt)
    s = llm.prefix_cache_stats()
    return {"alpha": alpha, "hit_bonus": bonus, "hit_rate": s["hits"] / s["queries"], "hits": s["hits"], "queries": s["queries"],
            "recomputed_tokens": s["recomputed_tokens"], "checkpoint_evictions": s["checkpoint_evictions"],
            "hit_rate_by_kind": {k: v[0] / v[1] for k, v in per_kind.items()}, "wall_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-checkpoints", type=int, default=4)
    ap.add_argument("--host-checkpoints", type=int, default=4)
    ap.add_argument("--alphas", default=",".join(f"{a:g}" for a in ALPHAS), help="comma-separated alphas")
    ap.add_argument("--bonuses", default=",".join(f"{b:g}" for b in BONUSES), help="comma-separated hit bonuses")
    ap.add_argument("--out", default="bench/results/checkpoint_eviction", help="output path prefix")
    ap.add_argument("--workload-scale", type=float, default=1.0,
                    help="multiplies the questions, chats and one-off prompts (default 1: the documented workload)")
    args = ap.parse_args(argv)
    alphas = [float(a) for a in args.alphas.split(",")]
    bonuses = [float(b) for b in args.bonuses.split(",")]
    import torch
    from tiny_checkpoint import make_tiny_checkpoint

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(os.path.join(tmp, "next"), "qwen3_next", seed=2, max_position_embeddings=2048)
        results = [run(ckpt, a, b, args.device_checkpoints, args.host_checkpoints, args.workload_scale)
                   for b in bonuses for a in alphas]
    for r in results:
        print(json.dumps(r), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"device_checkpoints": args.device_checkpoints, "host_checkpoints": args.host_checkpoints,
                   "results": results}, f, indent=2)
    kinds = sorted(results[0]["hit_rate_by_kind"])
    lines = [f"# State-checkpoint eviction: hit rate against alpha ({args.device_checkpoints} device + "
             f"{args.host_checkpoints} host checkpoints)", "",
             "| alpha | hit bonus | hit rate | " + " | ".join(f"{k} hit rate" for k in kinds) + " | recomputed tokens | "
             "checkpoint evictions |", "|---:|---:|---:|" + "---:|" * len(kinds) + "---:|---:|"]
    for r in results:
        lru = r["alpha"] == 0 and r["hit_bonus"] == 0
        lines.append(f"| {r['alpha']:g}{' (LRU)' if lru else ''} | {r['hit_bonus']:g} | {r['hit_rate']:.1%} | "
                     + " | ".join(f"{r['hit_rate_by_kind'][k]:.1%}" for k in kinds)
                     + f" | {r['recomputed_tokens']} | {r['checkpoint_evictions']} |")
    write_markdown(args.out + ".md", lines)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for b in bonuses:
            rs = [r for r in results if r["hit_bonus"] == b]
            ax.plot([r["alpha"] for r in rs], [100 * r["hit_rate"] for r in rs], "o-", label=f"hit bonus {b:g}")
        ax.set_xlabel("eviction alpha (0 = LRU)")
        ax.set_ylabel("hit rate (%)")
        ax.set_title("Hybrid prefix cache under a tight checkpoint budget")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
