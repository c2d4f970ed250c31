"""Quantized checkpoints against bf16: the same random preset in bf16, FP8 block-wise
(128 x 128) and int4 (compressed-tensors pack-quantized, group 128), each engine run in its
own process, greedy with `ignore_eos`.

1. Decode tok/s at 1 and 16 concurrent requests, all experts resident.
2. TPOT under a fixed `expert_budget` in bytes (`--budget-fraction` of the bf16 routed
   experts, 25% by default, the same bytes for every format), experts read from disk
   (page cache dropped first), no host cache: misses, bytes read per tier, stall seconds.
3. Experts resident per GiB of each format (moestream's own packed sizes, from the formats'
   stored tensors at the trace model's shapes) and, with `--trace` (a DeepSeek prompt-routing
   .npz), the hit rate at one fixed byte budget replayed through the trace simulator with
   each format's slot count.

The quantized copies are written once next to the bf16 checkpoint by
`bench/quantize_checkpoint.py`. Writes OUT.json, OUT.md and OUT.png.

    python bench/quantized.py --checkpoint medium --out bench/results/quantized_medium
    python bench/quantized.py --checkpoint small --trace deepseek_v2_lite_prompt_routing.npz
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from expert_offload import drop_page_cache  # noqa: E402
from report import pyplot, resolve_checkpoint, spawn_worker, wait_for_idle, write_markdown  # noqa: E402

# format name -> (bench/quantize_checkpoint.py format, group / block size); None = the bf16 checkpoint
FORMATS: dict[str, tuple[str, int] | None] = {"bf16": None, "fp8-block": ("fp8-block", 128), "int4": ("ct-int4", 128)}
# DeepSeek-V2-Lite's routed experts, the shapes of the routing trace
TRACE_SHAPE = dict(hidden=2048, inter=1408, layers=26, experts=64)


def quantized_copy(ckpt: str, fmt: str) -> str:
    """The checkpoint in format `fmt` (bf16: itself), written once beside it."""
    if FORMATS[fmt] is None:
        return ckpt
    from quantize_checkpoint import quantize_checkpoint

    name, group = FORMATS[fmt]
    out = f"{ckpt.rstrip('/')}-{fmt}"
    if not os.path.isfile(os.path.join(out, "config.json")):
        print(f"writing {out}", flush=True)
        quantize_checkpoint(ckpt, out, None, name, group_size=group)
    return out


def _prompts(n: int, length: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(n)]


def run_worker(spec: dict) -> dict:
    """One engine in this process: decode at each concurrency, or one paged run."""
    import torch

    from moestream import LLM, SamplingParams

    torch.set_num_threads(spec["threads"])
    if spec["mode"] == "paged":
        drop_page_cache(spec["checkpoint"])
    kw = dict(expert_budget=spec["budget"], expert_host_cache_bytes=0) if spec["mode"] == "paged" else {}
    start = time.perf_counter()
    llm = LLM(spec["checkpoint"], dtype="bfloat16", threads=spec["threads"],
              max_model_len=min(1024, spec["prompt_len"] + spec["new_tokens"] + 16), **kw)
    out = {"load_s": time.perf_counter() - start, "expert_bytes": llm.llm_engine.expert_plan.expert_bytes,
           "num_slots": llm.llm_engine.expert_plan.num_slots}
    params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True)
    llm.generate({"prompt_token_ids": _prompts(1, 16)[0]}, SamplingParams(max_tokens=2))  # warm-up
    for c in spec["concurrency"]:
        prompts = [{"prompt_token_ids": p} for p in _prompts(c, spec["prompt_len"])]
        before = llm.expert_stats()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tpot = [(o.metrics.last_token_time - o.metrics.first_token_time) / max(len(o.outputs[0].token_ids) - 1, 1)
                for o in outs]
        after = llm.expert_stats()
        out[str(c)] = {
            "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
            "tpot_s": sum(tpot) / len(tpot),
            "misses": after.get("misses", 0) - before.get("misses", 0),
            "bytes_read_disk": after.get("bytes_read_per_tier", {}).get("disk", 0)
            - before.get("bytes_read_per_tier", {}).get("disk", 0),
            "stall_seconds": after.get("stall_seconds", 0.0) - before.get("stall_seconds", 0.0),
            "first_tokens": outs[0].outputs[0].token_ids[:8],
        }
    return out


def _spawn(spec: dict) -> dict:
    return spawn_worker(__file__, spec)


def experts_per_gib(trace: str | None, budget_fraction: float) -> dict:
    """Per format: packed bytes of one DeepSeek-V2-Lite expert (moestream's layout of the
    format's stored tensors), experts per GiB and, with a trace, the hit rate at one byte
    budget (`budget_fraction` of the bf16 experts) with each format's slot count (the first 200 prompts, LRU and next_use)."""
    from moestream.config.quantization import QuantizationConfig
    from moestream.experts.policy import make_policy
    from moestream.quantization.packed import packed_layout
    from moestream.quantization.registry import make_quant_method

    h, i = TRACE_SHAPE["hidden"], TRACE_SHAPE["inter"]
    configs = {"fp8-block": QuantizationConfig("fp8", weight_block_size=(128, 128)),
               "int4": QuantizationConfig("compressed-tensors", format="pack-quantized", bits=4, strategy="group",
                                          group_size=128)}
    sizes = {"bf16": 3 * h * i * 2}
    for fmt, qcfg in configs.items():
        method = make_quant_method(qcfg)
        matrices = (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))
        parts = [(m, suffix, spec.dtypes[0], spec.shapes[0]) for m, shape in matrices
                 for suffix, spec in method.parts(m, shape).items()]
        sizes[fmt] = packed_layout(method, matrices, parts).nbytes
    total = TRACE_SHAPE["layers"] * TRACE_SHAPE["experts"]
    budget = int(budget_fraction * total * sizes["bf16"])
    out = {fmt: {"expert_bytes": n, "experts_per_gib": (1 << 30) / n, "slots_at_budget": min(budget // n, total)}
           for fmt, n in sizes.items()}
    if trace:
        from moestream.experts.trace import RoutingTrace
        from moestream.experts.trace_sim import simulate

        rt = RoutingTrace.from_deepseek_npz(trace, max_prompts=200)  # as trace-sim's default
        for fmt, row in out.items():
            for policy in ("lru", "next_use"):
                res = simulate(rt, make_policy(policy), row["slots_at_budget"])
                row[f"hit_rate_{policy}"] = res.hits / max(res.hits + res.misses, 1)
    return {"budget_bytes": budget, "budget_fraction": budget_fraction, "shape": TRACE_SHAPE, "formats": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="medium", help="a bf16 directory or a make_checkpoint.py preset")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine (default: 1)")
    ap.add_argument("--new-tokens", type=int, default=64, help="output tokens per request (default: 64)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default: 128)")
    ap.add_argument("--concurrency", default="1,16",
                    help="concurrent requests of the resident runs, starting with 1 (default: 1,16)")
    ap.add_argument("--budget-fraction", type=float, default=0.25,
                    help="paged runs' budget, a fraction of the bf16 routed-expert bytes (default: 0.25)")
    ap.add_argument("--paged-tokens", type=int, default=32, help="output tokens of the paged runs (default: 32)")
    ap.add_argument("--trace", default=None, help="a DeepSeek prompt-routing .npz for part 3's hit rates")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"subset of {', '.join(FORMATS)}")
    ap.add_argument("--out", default="bench/results/quantized", help="output path prefix")
    ap.add_argument("--max-wait", type=float, default=180.0, help="seconds to wait at most for an idle machine")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return 0
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        ap.error(f"--formats: unknown {unknown}; valid: {', '.join(FORMATS)}")
    ckpt = resolve_checkpoint(args.checkpoint)
    dirs = {f: quantized_copy(ckpt, f) for f in formats}
    sys.path.insert(0, ROOT)
    from moestream.models.hf_config import model_config_from_dict

    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = model_config_from_dict(json.load(f))
    bf16_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    budget = int(args.budget_fraction * sum(cfg.moe_layers) * cfg.num_experts * bf16_expert)
    load = wait_for_idle(args.max_wait)
    conc = [int(c) for c in args.concurrency.split(",")]
    resident, paged = {}, {}
    for fmt in formats:
        resident[fmt] = _spawn({"mode": "resident", "checkpoint": dirs[fmt], "threads": args.threads,
                                "concurrency": conc, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len})
        print(fmt, "resident", {c: round(resident[fmt][str(c)]["tok_s"], 1) for c in conc}, flush=True)
    for fmt in formats:
        paged[fmt] = _spawn({"mode": "paged", "checkpoint": dirs[fmt], "threads": args.threads, "budget": budget,
                             "concurrency": [1], "new_tokens": args.paged_tokens, "prompt_len": args.prompt_len})
        print(fmt, "paged", round(paged[fmt]["1"]["tpot_s"] * 1e3, 1), "ms TPOT", flush=True)
    density = experts_per_gib(args.trace, args.budget_fraction)
    n = min(args.new_tokens, args.paged_tokens, 8)  # the same first prompt, resident and paged: same tokens
    same = all(paged[f]["1"]["first_tokens"][:n] == resident[f]["1"]["first_tokens"][:n] for f in formats)
    meta = {"checkpoint": args.checkpoint, "threads": args.threads, "new_tokens": args.new_tokens,
            "paged_equals_resident": same,
            "prompt_len": args.prompt_len, "budget_bytes": budget, "budget_fraction": args.budget_fraction,
            "load_before": round(load, 2), "busy": load > 0.5}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "resident": resident, "paged": paged, "density": density}, f, indent=2)
    base = "bf16" if "bf16" in formats else formats[0]
    lines = [f"# Quantized checkpoints on `{args.checkpoint}` (bf16 compute, {args.threads} thread, "
             f"{args.prompt_len}-token prompts{', machine busy' if meta['busy'] else ''})", "",
             "| format | expert bytes | " + " | ".join(f"c{c} tok/s | c{c} vs {base}" for c in conc)
             + f" | TPOT at {budget / 2**20:.1f} MiB (ms) | vs {base} | slots | misses | bytes read (MiB) | stall (s) |",
             "|---|---:|" + "---:|---:|" * len(conc) + "---:|---:|---:|---:|---:|---:|"]
    for fmt in formats:
        r, p = resident[fmt], paged[fmt]["1"]
        cells = [f"{r[str(c)]['tok_s']:.1f} | {r[str(c)]['tok_s'] / resident[base][str(c)]['tok_s']:.2f}x" for c in conc]
        lines.append(f"| {fmt} | {r['expert_bytes']} | " + " | ".join(cells)
                     + f" | {p['tpot_s'] * 1e3:.1f} | {p['tpot_s'] / paged[base]['1']['tpot_s']:.2f}x "
                     f"| {paged[fmt]['num_slots']} | {p['misses']} | {p['bytes_read_disk'] / 2**20:.1f} "
                     f"| {p['stall_seconds']:.2f} |")
    lines += ["", f"Experts per GiB at DeepSeek-V2-Lite's expert shape (hidden {TRACE_SHAPE['hidden']}, "
              f"moe_intermediate {TRACE_SHAPE['inter']}), slots and trace hit rates at "
              f"{density['budget_bytes'] / 2**30:.2f} GiB ({args.budget_fraction:.0%} of the bf16 experts):", "",
              "| format | expert bytes | experts per GiB | slots | hit rate LRU | hit rate next_use |",
              "|---|---:|---:|---:|---:|---:|"]
    for fmt, row in density["formats"].items():
        hits = [f"{row[k]:.3f}" if k in row else "-" for k in ("hit_rate_lru", "hit_rate_next_use")]
        lines.append(f"| {fmt} | {row['expert_bytes']} | {row['experts_per_gib']:.1f} | {row['slots_at_budget']} | "
                     f"{hits[0]} | {hits[1]} |")
    write_markdown(args.out + ".md", lines)
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for j, c in enumerate(conc):
            axes[0].bar([x + 0.4 * j for x in range(len(formats))], [resident[f][str(c)]["tok_s"] for f in formats],
                        0.4, label=f"c{c}")
        axes[0].set_xticks([x + 0.2 for x in range(len(formats))], formats)
        axes[0].set_ylabel("decode tok/s (resident)")
        axes[0].legend()
        axes[1].bar(formats, [paged[f]["1"]["tpot_s"] * 1e3 for f in formats])
        axes[1].set_ylabel(f"TPOT ms at {budget / 2**20:.0f} MiB of experts")
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
