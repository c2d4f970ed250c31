"""Profile moestream's decode step: N concurrent requests, prefill done first, then `--steps`
decode steps under torch.profiler (operator self-time) and cProfile (Python time per function).

Writes bench/results/profile_decode.txt (both tables) and .json (top operators and functions).

    python bench/profile_decode.py --checkpoint small --concurrency 16 --steps 16 --threads 1
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="small", help="a directory or a bench/make_checkpoint.py preset")
    ap.add_argument("--checkpoint-cache", default="/tmp/moestream-bench")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: no OpenMP oversubscription on a shared machine)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "profile_decode"))
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    import torch
    from throughput import resolve_checkpoint

    from moestream import LLM, SamplingParams

    ckpt = resolve_checkpoint(args.checkpoint, args.checkpoint_cache)
    # the engine sets torch's thread count itself (its default "auto" is every core)
    llm = LLM(ckpt, dtype=args.dtype, max_model_len=args.prompt_len + 3 * args.steps + 64,
              max_num_seqs=args.concurrency, threads=args.threads)
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=3 * args.steps + 32, ignore_eos=True)
    for i in range(args.concurrency):
        engine.add_request({"prompt_token_ids": [rng.randrange(100, 150000) for _ in range(args.prompt_len)]},
                           params, request_id=str(i))
    t = time.perf_counter()
    while not all(engine.requests[str(i)].output_token_ids for i in range(args.concurrency)):
        engine.step()  # prefill (chunked) until every request has its first token
    prefill = time.perf_counter() - t
    for _ in range(args.steps):  # warm decode steps
        engine.step()
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    plain = (time.perf_counter() - t) / args.steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False) as prof:
        for _ in range(args.steps):
            engine.step()
    ops = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in ops)
    top_ops = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.steps):
        engine.step()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(args.top * 2)
    s2 = io.StringIO()
    pstats.Stats(pr, stream=s2).sort_stats("tottime").print_stats(args.top)
    header = (f"checkpoint {ckpt}, {args.dtype}, {args.concurrency} requests in decode, {torch.get_num_threads()} "
              f"threads, load {os.getloadavg()[0]:.1f}: {plain * 1e3:.1f} ms per decode step "
              f"({args.concurrency / plain:.1f} output tok/s); prefill of {args.concurrency} x {args.prompt_len} "
              f"tokens {prefill:.2f} s (first run, includes warm-up)\n")
    lines = [header, "torch.profiler: operators by self CPU time", f"{'op':45s} {'calls':>7s} {'self ms/step':>13s} {'share':>6s}"]
    for e in top_ops:
        lines.append(f"{e.key[:45]:45s} {e.count // args.steps:7d} {e.self_cpu_time_total / 1e3 / args.steps:13.2f} "
                     f"{e.self_cpu_time_total / total_us:6.1%}")
    text = "\n".join(lines) + "\n\ncProfile, by cumulative time:\n" + s.getvalue() + "\ncProfile, by own time:\n" + s2.getvalue()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".txt", "w") as f:
        f.write(text)
    with open(args.out + ".json", "w") as f:
        json.dump({"checkpoint": ckpt, "concurrency": args.concurrency, "steps": args.steps,
                   "decode_step_s": plain, "prefill_s": prefill, "load": os.getloadavg()[0],
                   "top_ops": [{"op": e.key, "calls_per_step": e.count / args.steps,
                                "self_s_per_step": e.self_cpu_time_total / 1e6 / args.steps,
                                "share": e.self_cpu_time_total / total_us} for e in top_ops]}, f, indent=2)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
