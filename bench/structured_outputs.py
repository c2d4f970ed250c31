"""Per-token cost of structured outputs: decode TPOT of N concurrent requests with a JSON
schema (llguidance masks every sampling row) against the same requests without one, on one
checkpoint, each configuration in its own process. Outputs differ (the constraint changes
them), so every request runs a fixed number of tokens (`ignore_eos`; a finished grammar then
allows only end-of-sequence, which still costs a mask).

Writes OUT.json, OUT.md and OUT.png.

    python bench/structured_outputs.py [--checkpoint small] [--concurrency 1 16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from report import pyplot, resolve_checkpoint, spawn_worker, wait_for_idle, write_markdown

# A JSON schema of the usual structured-output kind: nested object, enum, bounded array.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["module", "class", "function"]},
        "args": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
        "meta": {"type": "object", "properties": {"public": {"type": "boolean"}}, "required": ["public"]},
    },
    "required": ["name", "kind", "args", "meta"],
}


def run_worker(spec: dict) -> dict:
    """One engine: `concurrency` requests of `tokens` output tokens, constrained or not; mean TPOT."""
    import torch

    from moestream import LLM, SamplingParams
    from moestream.structured_output.params import StructuredOutputsParams

    torch.set_num_threads(spec["threads"])
    llm = LLM(spec["checkpoint"], dtype=spec["dtype"], max_model_len=512, threads=spec["threads"])
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if spec["constrained"] else None
    params = SamplingParams(temperature=0, max_tokens=spec["tokens"], ignore_eos=True, structured_outputs=so)
    prompts = [f"def function_{i}(x):" for i in range(spec["concurrency"])]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, structured_outputs=so))  # warm-up (compile, kernels)
    outs = llm.generate(prompts, params)
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    return {"tpot_mean_s": sum(tpots) / len(tpots), "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="small", help="directory, 'demo' or a make_checkpoint.py preset")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request (default: 64)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/structured_outputs", help="output path prefix")
    ap.add_argument("--max-wait", type=float, default=180.0, help="seconds to wait at most for an idle machine")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return 0
    ckpt = args.checkpoint if args.checkpoint == "demo" else resolve_checkpoint(args.checkpoint)
    load = wait_for_idle(args.max_wait)
    rows = []
    for c in args.concurrency:
        got = {}
        for constrained in (False, True):
            spec = dict(checkpoint=ckpt, dtype=args.dtype, concurrency=c, tokens=args.tokens, threads=args.threads,
                        constrained=constrained)
            got[constrained] = spawn_worker(os.path.abspath(__file__), spec)
        rows.append({"concurrency": c, "tpot_plain_ms": got[False]["tpot_mean_s"] * 1e3,
                     "tpot_json_schema_ms": got[True]["tpot_mean_s"] * 1e3,
                     "overhead": got[True]["tpot_mean_s"] / got[False]["tpot_mean_s"] - 1.0})
    meta = {"checkpoint": args.checkpoint, "dtype": args.dtype, "threads": args.threads, "tokens": args.tokens,
            "load_average_at_start": load, "schema": SCHEMA}
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"`{args.checkpoint}` {args.dtype}, {args.threads} thread(s), {args.tokens} output tokens per request, "
             f"load average {load:.2f} at start", "",
             "| concurrent | TPOT plain (ms) | TPOT JSON schema (ms) | overhead |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['concurrency']} | {r['tpot_plain_ms']:.1f} | {r['tpot_json_schema_ms']:.1f} | "
              f"{r['overhead']:+.1%} |" for r in rows]
    write_markdown(args.out + ".md", lines)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["tpot_plain_ms"] for r in rows], 0.4, label="no constraint")
        ax.bar([i + 0.2 for i in x], [r["tpot_json_schema_ms"] for r in rows], 0.4, label="JSON schema")
        ax.set_xticks(list(x), [f"c{r['concurrency']}" for r in rows])
        ax.set_ylabel("TPOT (ms)")
        ax.legend(fontsize=8)
        ax.set_title(f"structured outputs on {args.checkpoint}")
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
