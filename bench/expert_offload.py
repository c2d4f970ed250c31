"""Expert offloading benchmark: decode speed and I/O of moestream at several expert budgets.

Makes (once) a Qwen3-MoE-shaped checkpoint with ~3 GiB of random bf16 experts (or takes
`--model`, e.g. the built-in demo model, for real routing), then for each budget (100, 50,
25, 12.5 % of the routed-expert bytes), batch size (1, 8), eviction policy, prefetch mode and
host-cache and elastic-memory setting runs greedy decoding from a cold page cache and reports TPOT, tokens/s,
expert hit rate, stall share, bytes read, misses computed in place from the host cache, and
the I/O floor (bytes missed / measured disk bandwidth) next to TPOT. On a CPU device,
prefetch is page-cache read-ahead and a host-cache miss is computed where it lies.
Writes bench/results/expert_offload.{json,md,png}.

    python bench/expert_offload.py [--ckpt /tmp/moestream-offload-ckpt] [--max-tokens 16]
    python bench/expert_offload.py --model demo --budgets 1.0,0.25 --policies lru,next_use
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "tokenizers", "qwen2")


def make_checkpoint(path: str, layers: int, experts: int, hidden: int, inter: int, seed: int = 0) -> None:
    """Random-weight Qwen3-MoE checkpoint in bf16, written shard by shard with transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=151936, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=experts,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=151643, bos_token_id=151643,
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="1GB")
    for f in os.listdir(TOKENIZER):
        shutil.copy(os.path.join(TOKENIZER, f), path)


def drop_page_cache(path: str) -> None:
    """Evict the checkpoint's files from the OS page cache (cold disk)."""
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            fd = os.open(os.path.join(path, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_bandwidth(path: str, read_bytes: int, nbytes: int = 256 << 20) -> float:
    """Cold random reads of `read_bytes` chunks (one expert tensor's size): bytes/second."""
    files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    drop_page_cache(path)
    rng = random.Random(0)
    buf = bytearray(read_bytes)
    done, start = 0, time.perf_counter()
    while done < nbytes:
        f = rng.choice(files)
        fd = os.open(f, os.O_RDONLY)
        size = os.path.getsize(f)
        os.preadv(fd, [memoryview(buf)], rng.randrange(0, max(size - read_bytes, 1)))
        os.close(fd)
        done += read_bytes
    return done / (time.perf_counter() - start)


TEXT_PROMPTS = [  # real text for a trained model (`--model`): its routing is real routing
    "def parse_args(argv):", "class LRUCache:\n    def __init__(self, capacity):", "import os\nimport sys\n\ndef main():",
    "def fibonacci(n):", "for line in open(path):", "def read_config(path):\n    with open(path) as f:",
    "try:\n    import json\nexcept ImportError:", "def merge_sort(items):",
]


def run_one(ckpt: str, budget: float, batch: int, max_tokens: int, prompt_len: int, prefetch: str, policy: str,
            host_cache_bytes: int, dtype: str, text: bool, elastic: bool, kv_cache_blocks: int | None) -> dict:
    from moestream import LLM, SamplingParams

    drop_page_cache(ckpt)
    t0 = time.perf_counter()
    max_model_len = prompt_len + max_tokens + 8
    kv_bytes = None
    if kv_cache_blocks is not None:  # a small KV cache: KV demand passes the static split
        from moestream.models.hf_config import model_config_from_hf
        from moestream.engine.kv_cache import kv_block_bytes

        mc = model_config_from_hf(ckpt)
        kv_bytes = kv_cache_blocks * kv_block_bytes(len(mc.attention_layers), 16, mc.num_kv_heads, mc.head_dim,
                                                    getattr(torch, dtype))
    llm = LLM(ckpt, dtype=dtype, max_model_len=max_model_len, max_num_seqs=batch,
              expert_budget=None if budget >= 1.0 else budget, expert_prefetch=prefetch, expert_policy=policy,
              expert_host_cache_bytes=host_cache_bytes, kv_cache_memory_bytes=kv_bytes,
              enable_elastic_memory=elastic and budget < 1.0)
    load_s = time.perf_counter() - t0
    rng = random.Random(1)
    prompts = ([TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(batch)] if text else
               [{"prompt_token_ids": [rng.randrange(100, 100000) for _ in range(prompt_len)]} for _ in range(batch)])
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = llm.expert_stats()
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t1
    stats = llm.expert_stats()
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {
        "budget": budget,
        "batch": batch,
        "prefetch": prefetch if budget < 1.0 else "-",
        "policy": policy if budget < 1.0 else "-",
        "host_cache_bytes": host_cache_bytes if budget < 1.0 else 0,
        "host_computed": stats.get("host_computed", 0),
        "elastic": elastic and budget < 1.0,
        "preemptions": llm.llm_engine.scheduler.num_preemptions,
        "elastic_resizes": stats.get("elastic_memory", {}).get("resizes", 0),
        "load_seconds": load_s,
        "tpot_s": sum(tpots) / len(tpots),
        "ttft_s": sum(o.metrics.ttft for o in outs) / len(outs),
        "tokens_per_s": tokens / wall,
        "hit_rate": stats["hit_rate"],
        "stall_seconds": stats["stall_seconds"] - before.get("stall_seconds", 0.0),
        "stall_share": (stats["stall_seconds"] - before.get("stall_seconds", 0.0)) / wall,
        "bytes_read": stats["bytes_read"],
        "missed_bytes": stats.get("misses", 0) * stats.get("expert_bytes", 0),
        "prefetch_hits": stats.get("prefetch_hits", 0),
        "prefetch_bytes": stats.get("prefetch_bytes", 0),
        "wasted_prefetch_bytes": stats.get("wasted_prefetch_bytes", 0),
        "wall_seconds": wall,
        "output_token_ids": [o.outputs[0].token_ids for o in outs],
    }
    del llm
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default="/tmp/moestream-offload-ckpt")
    ap.add_argument("--model", default=None,
                    help="an existing trained checkpoint directory or 'demo' (the built-in demo model) instead of "
                         "--ckpt; prompts are then code snippets, so the routing is the model's real routing")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    ap.add_argument("--budgets", default="1.0,0.5,0.25,0.125")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prefetch", default="none,gate", help="prefetch modes to compare at budgets below 100%%")
    ap.add_argument("--policies", default="lru,next_use", help="eviction policies to compare at budgets below 100%%")
    ap.add_argument("--elastic", default="off", help="elastic memory settings to compare: off, on or off,on")
    ap.add_argument("--kv-cache-blocks", type=int, default=None,
                    help="KV cache size in 16-token blocks (default: enough for the batch); below the batch's need, "
                         "the static split preempts and elastic memory borrows expert slots")
    ap.add_argument("--host-cache", default="0",
                    help="host-cache sizes to compare, as fractions of the routed-expert bytes (default: 0)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "expert_offload"))
    ap.add_argument("--bandwidth-bytes", type=int, default=256 << 20, help="bytes read to measure disk bandwidth")
    args = ap.parse_args()
    if args.model is not None:
        from moestream.demo import demo_model_path

        args.ckpt = demo_model_path() if args.model == "demo" else args.model
    elif not os.path.exists(os.path.join(args.ckpt, "config.json")):
        print(f"making checkpoint in {args.ckpt} ...", flush=True)
        make_checkpoint(args.ckpt, args.layers, args.experts, args.hidden, args.moe_intermediate)
    from moestream.models.hf_config import model_config_from_hf

    cfg = model_config_from_hf(args.ckpt)
    expert_tensor_bytes = cfg.moe_intermediate_size * cfg.hidden_size * torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    expert_total = sum(cfg.moe_layers) * cfg.num_experts * 3 * expert_tensor_bytes
    bw = disk_bandwidth(args.ckpt, expert_tensor_bytes, args.bandwidth_bytes)
    print(f"routed experts: {expert_total / 2**30:.2f} GiB; cold random-read bandwidth {bw / 2**20:.0f} MiB/s", flush=True)
    rows = []
    paged = [(prefetch, policy, float(host), elastic == "on") for prefetch in args.prefetch.split(",")
             for policy in args.policies.split(",") for host in args.host_cache.split(",")
             for elastic in args.elastic.split(",")]
    runs = [(batch, budget, setting)
            for batch in [int(b) for b in args.batches.split(",")]
            for budget in [float(b) for b in args.budgets.split(",")]
            for setting in (paged if budget < 1.0 else [("none", "lru", 0.0, False)])]
    for batch, budget, (prefetch, policy, host, elastic) in runs:
        row = run_one(args.ckpt, budget, batch, args.max_tokens, args.prompt_len, prefetch, policy,
                      int(host * expert_total), args.dtype, text=args.model is not None, elastic=elastic,
                      kv_cache_blocks=args.kv_cache_blocks)
        # misses computed in place from the host cache read nothing from the disk
        row["io_floor_tpot_s"] = (row["missed_bytes"] - row["host_computed"] * 3 * expert_tensor_bytes) / bw / (
            args.max_tokens + 1)
        rows.append(row)
        print(f"budget {budget:>5.3f} batch {batch} prefetch {row['prefetch']} policy {row['policy']} host "
              f"{host:.0%}: TPOT {row['tpot_s'] * 1e3:8.1f} ms, "
              f"{row['tokens_per_s']:6.2f} tok/s, hit rate {row['hit_rate']:.3f}, stall {row['stall_share']:.0%}, "
              f"read {row['bytes_read'] / 2**30:.2f} GiB, I/O floor {row['io_floor_tpot_s'] * 1e3:.1f} ms/token", flush=True)
    for batch in {r["batch"] for r in rows}:
        same = [r["output_token_ids"] for r in rows if r["batch"] == batch]
        assert all(s == same[0] for s in same), "outputs differ across budgets"
    meta = {"checkpoint": args.ckpt, "routed_expert_bytes": expert_total, "disk_bandwidth_bytes_per_s": bw,
            "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, "threads": torch.get_num_threads(),
            "outputs_identical_across_budgets": True}
    for r in rows:
        r.pop("output_token_ids")
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    elastic_cols = args.elastic != "off"
    lines = ["| budget | batch | prefetch | policy | host cache | " + ("elastic | preempted | resizes | " if elastic_cols
                                                                    else "") +
             "TPOT (ms) | I/O floor (ms/token) | tok/s | hit rate | in place | stall share | read (GiB) | "
             "wasted prefetch (GiB) |",
             "|---:|---:|---|---|---:|" + ("---|---:|---:|" if elastic_cols else "") + "---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        extra = f"{'on' if r['elastic'] else 'off'} | {r['preemptions']} | {r['elastic_resizes']} | " if elastic_cols else ""
        lines.append(f"| {r['budget']:.1%} | {r['batch']} | {r['prefetch']} | {r['policy']} | "
                     f"{r['host_cache_bytes'] / expert_total:.0%} | {extra}{r['tpot_s'] * 1e3:.1f} | "
                     f"{r['io_floor_tpot_s'] * 1e3:.1f} | {r['tokens_per_s']:.2f} | {r['hit_rate']:.3f} | "
                     f"{r['host_computed']} | {r['stall_share']:.0%} | {r['bytes_read'] / 2**30:.2f} | {r['wasted_prefetch_bytes'] / 2**30:.2f} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        for batch in sorted({r["batch"] for r in rows}):
            for prefetch, policy, host, elastic in paged:
                rs = [r for r in rows if r["batch"] == batch and (r["prefetch"] == "-" or (
                    r["prefetch"], r["policy"], r["host_cache_bytes"], r["elastic"]) == (
                    prefetch, policy, int(host * expert_total), elastic))]
                xs = [r["budget"] * 100 for r in rs]
                label = (f"batch {batch}, {policy}, prefetch {prefetch}" + (f", host {host:.0%}" if host else "")
                         + (", elastic" if elastic else ""))
                ax[0].plot(xs, [r["tpot_s"] * 1e3 for r in rs], "o-", label=f"TPOT, {label}")
                ax[1].plot(xs, [r["hit_rate"] for r in rs], "o-", label=label)
            rs = [r for r in rows if r["batch"] == batch and (r["prefetch"] == "-" or (
                r["prefetch"], r["policy"], r["host_cache_bytes"], r["elastic"]) == paged[0][:2] + (
                int(paged[0][2] * expert_total), paged[0][3]))]
            ax[0].plot([r["budget"] * 100 for r in rs], [r["io_floor_tpot_s"] * 1e3 for r in rs], "x--",
                       label=f"I/O floor (misses / cold bandwidth), batch {batch}")
        ax[0].set(xlabel="expert budget (% of routed-expert bytes)", ylabel="ms per output token", yscale="log")
        ax[1].set(xlabel="expert budget (%)", ylabel="expert hit rate", ylim=(0, 1.05))
        for a in ax:
            a.invert_xaxis()
            a.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
