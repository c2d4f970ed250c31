"""Speculative decoding (n-gram drafts) against plain decode: TPOT, decode tok/s and
acceptance on three workloads, one request at a time, greedy.

- `edit`: a code-editing-like prompt that holds most of its answer: a Python function from
  the standard library, then "# The same function, unchanged:" and its first line;
- `chat`: the first lines of 8 standard-library modules, continued freely;
- `random`: 8 prompts of random token ids.

Each method runs in its own process (float32, `--threads` torch threads): off, and ngram with
k = 1, 3, 5 (prompt_lookup_min 2, prompt_lookup_max 4). 64 output tokens per request
(`ignore_eos`). Ratios are against off from the same run.

    python bench/spec_decode.py --checkpoint demo --out bench/results/spec_decode_demo
    python bench/spec_decode.py --checkpoint small --out bench/results/spec_decode_small

`--checkpoint` takes a directory, `demo` (the packaged trained demo model) or a preset of
bench/make_checkpoint.py. Writes OUT.json, OUT.md and OUT.png.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from report import pyplot, resolve_checkpoint, wait_for_idle, write_markdown  # noqa: E402

NEW_TOKENS = 64
METHODS = {"off": None, **{f"ngram k={k}": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                                              "prompt_lookup_max": 4} for k in (1, 3, 5)}}
WORKLOADS = ("edit", "chat", "random")


def workloads(tokenizer) -> dict[str, list[list[int]]]:
    """Token ids of each workload's 8 prompts (deterministic)."""
    import argparse as m1
    import collections as m2
    import functools as m3
    import json as m4
    import os as m5
    import random as m6
    import string as m7
    import textwrap as m8

    modules = [m1, m2, m3, m4, m5, m6, m7, m8]
    funcs = [m3.total_ordering, m8.dedent, m7.capwords, m6.Random.shuffle, m8.indent, m4.dumps, m2.namedtuple,
             m1.ArgumentParser.add_argument]
    edit = []
    for f in funcs:
        src = inspect.getsource(f)
        src = "\n".join(src.splitlines()[:40])
        edit.append(src + "\n\n# The same function, unchanged:\n" + src.splitlines()[0] + "\n")
    chat = ["\n".join(inspect.getsource(m).splitlines()[:6]) + "\n" for m in modules]
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    rand = [[rng.randrange(100, vocab) for _ in range(64)] for _ in range(8)]
    enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"][-400:]  # noqa: E731
    return {"edit": [enc(t) for t in edit], "chat": [enc(t) for t in chat], "random": rand}


def run_worker(spec: dict) -> dict:
    """(subprocess) One method on every workload; per workload: TPOT, tok/s, acceptance."""
    import torch

    from moestream import LLM, SamplingParams

    torch.set_num_threads(spec["threads"])
    llm = LLM(spec["checkpoint"], dtype="float32", max_model_len=1024, speculative_config=spec["speculative"])
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    w = workloads(engine.tokenizer)
    llm.generate([{"prompt_token_ids": w["chat"][0]}], params)  # warm-up
    out = {}
    for name in WORKLOADS:
        before = llm.spec_decode_stats()
        tpots, decode_s, tokens, outputs = [], 0.0, 0, []
        for i, prompt in enumerate(w[name]):
            engine.add_request({"prompt_token_ids": prompt}, params, request_id=f"{name}{i}")
            first = done = None
            while engine.has_unfinished_requests():
                for o in engine.step():
                    now = time.perf_counter()
                    if first is None and o.outputs[0].token_ids:
                        first = now
                    if o.finished:
                        done, result = now, o
            n = len(result.outputs[0].token_ids)
            tpots.append((done - first) / (n - 1))
            decode_s += done - first
            tokens += n - 1
            outputs.append(result.outputs[0].token_ids)
        after = llm.spec_decode_stats()
        drafts = after["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        steps = after["num_drafts"] - before["num_drafts"]
        out[name] = {"tpot_mean_s": sum(tpots) / len(tpots), "decode_tok_s": tokens / decode_s,
                     "acceptance_rate": accepted / drafts if drafts else 0.0,
                     "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
                     "outputs": outputs}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="demo", help="directory, 'demo' or a make_checkpoint.py preset")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine (default: 1)")
    ap.add_argument("--out", default="bench/results/spec_decode", help="output path prefix")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return 0
    ckpt = args.checkpoint
    if ckpt == "demo":
        sys.path.insert(0, ROOT)
        from moestream.demo import demo_model_path

        ckpt = demo_model_path()
    else:
        ckpt = resolve_checkpoint(ckpt)
    load = wait_for_idle()
    results = {}
    for method, sc in METHODS.items():
        spec = {"checkpoint": ckpt, "threads": args.threads, "speculative": sc}
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], cwd=ROOT, capture_output=True,
                              text=True, env=dict(os.environ, PYTHONPATH=ROOT))
        if proc.returncode != 0:
            raise RuntimeError(f"worker failed: {proc.stderr[-3000:]}")
        results[method] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(method, {w: round(results[method][w]["decode_tok_s"], 1) for w in WORKLOADS}, flush=True)
    identical = all(results[m][w]["outputs"] == results["off"][w]["outputs"] for m in METHODS for w in WORKLOADS)
    for m in METHODS:  # compared above; the token lists themselves stay out of the JSON
        for w in WORKLOADS:
            del results[m][w]["outputs"]
    meta = {"checkpoint": args.checkpoint, "threads": args.threads, "new_tokens": NEW_TOKENS,
            "load_before": round(load, 2), "busy": load > 0.5, "outputs_identical_to_off": identical}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    lines = [f"# Speculative decoding on `{args.checkpoint}` (float32, {args.threads} thread, {NEW_TOKENS} greedy "
             f"tokens, one request at a time{', machine busy' if meta['busy'] else ''}; outputs identical to off: "
             f"{identical})", "",
             "| workload | method | TPOT (ms) | decode tok/s | TPOT off / TPOT | acceptance | mean accepted length |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for w in WORKLOADS:
        off = results["off"][w]["tpot_mean_s"]
        for m in METHODS:
            r = results[m][w]
            lines.append(f"| {w} | {m} | {1000 * r['tpot_mean_s']:.1f} | {r['decode_tok_s']:.1f} | "
                         f"{off / r['tpot_mean_s']:.2f}x | {r['acceptance_rate']:.1%} | {r['mean_acceptance_length']:.2f} |")
    write_markdown(args.out + ".md", lines)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        width = 0.8 / len(METHODS)
        for j, m in enumerate(METHODS):
            ax.bar([i + j * width for i in range(len(WORKLOADS))],
                   [results["off"][w]["tpot_mean_s"] / results[m][w]["tpot_mean_s"] for w in WORKLOADS], width, label=m)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(WORKLOADS))], list(WORKLOADS))
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_ylabel("TPOT speed-up vs off")
        ax.set_title(f"n-gram speculative decoding, {args.checkpoint}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
