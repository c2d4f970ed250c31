"""Approximate expert modes against exact mode: held-out loss delta, activated experts, TPOT
and misses, each configuration's engine in its own process.

Per checkpoint:
- exact with every expert resident, and exact at `--budget` (25% of the routed experts by
  default, no host cache, the page cache dropped first);
- at that budget: resident-fold for each `--thresholds` value (the curve a user picks from),
  resident-fold with ExFold's projectors at `--projector-thresholds`, EAT for each
  `--eat-thresholds` value, and ExFold for each `--exfold-pools` decode pool size (prompt
  tokens keep half the top-k). The projectors are calibrated first (`moestream calibrate`'s
  default text and flags, in their own process) into a temporary directory.

Each run scores the held-out text teacher-forced through the decode path (`moestream
eval-loss`'s `teacher_forced_loss`: `--num-seqs` sequences of `--seq-len` tokens decoding
together) and through the prefill path (`prefill_loss`: the same sequences as prompts, from
their prompt logprobs), and then times a plain greedy generation (`--requests` prompts of 16 held-out
tokens, `--new-tokens` each, `ignore_eos`): TPOT is the mean over requests of (last token
time - first token time) / (tokens - 1). `--speed-only` skips the loss (random presets).

Writes OUT.json, OUT.md and OUT.png.

    python bench/expert_modes.py --checkpoint demo
    python bench/expert_modes.py --checkpoint medium --speed-only --requests 8 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from expert_offload import drop_page_cache  # noqa: E402
from report import pyplot, resolve_checkpoint, spawn_worker, wait_for_idle, write_markdown  # noqa: E402

THRESHOLDS = (0.1, 0.25, 0.5, 1.0)
EAT_THRESHOLDS = (0.25, 0.5)


def run_worker(spec: dict) -> dict:
    """One engine in this process: the teacher-forced loss (unless speed only), then TPOT."""
    import torch

    from moestream import LLM, SamplingParams
    from moestream.demo import heldout_files
    from moestream.server.cli_eval_loss import prefill_loss, teacher_forced_loss

    torch.set_num_threads(spec["threads"])
    kw: dict = dict(dtype="float32", threads=spec["threads"], max_model_len=spec["seq_len"] + spec["new_tokens"] + 32,
                    enable_prefix_caching=False, expert_mode=spec["mode"])
    if spec["budget"] < 1.0:
        drop_page_cache(spec["checkpoint"])
        kw.update(expert_budget=spec["budget"], expert_host_cache_bytes=0)
    kw.update(spec["engine"])
    llm = LLM(spec["checkpoint"], **kw)
    tok = llm.get_tokenizer()
    texts = []
    for path in heldout_files()[: max(spec["num_seqs"], spec["requests"])]:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(tok.encode(f.read()))
    out: dict = {}
    if not spec["speed_only"]:
        r = teacher_forced_loss(llm, [t[: spec["seq_len"]] for t in texts[: spec["num_seqs"]]])
        out.update(loss=r["loss"], loss_tokens=r["tokens"], loss_misses=r["expert"].get("misses", 0),
                   mode_stats=r["expert"].get("expert_mode"))
        p = prefill_loss(llm, [t[: spec["seq_len"]] for t in texts[: spec["num_seqs"]]])
        out.update(prefill_loss=p["loss"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": t[:16]} for t in texts[: spec["requests"]]]
    rounds = []
    for _ in range(spec["rounds"]):  # the median round: this VM's speed wanders within a process too
        before = llm.expert_stats()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        after = llm.expert_stats()
        tpot = [(o.metrics.last_token_time - o.metrics.first_token_time) / max(len(o.outputs[0].token_ids) - 1, 1)
                for o in outs]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rounds.append(dict(tpot_s=sum(tpot) / len(tpot), tok_s=tokens / seconds,
                           misses_per_token=(after.get("misses", 0) - before.get("misses", 0)) / tokens,
                           stall_per_token_s=(after.get("stall_seconds", 0.0) - before.get("stall_seconds", 0.0))
                           / tokens))
    out.update(sorted(rounds, key=lambda r: r["tpot_s"])[len(rounds) // 2], rounds_tpot_s=[r["tpot_s"] for r in rounds],
               top_k=llm.llm_engine.model_config.num_experts_per_tok, final_mode_stats=llm.expert_stats().get("expert_mode"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="demo", help="a built-in model, a preset of make_checkpoint.py or a directory")
    ap.add_argument("--budget", type=float, default=0.25, help="expert budget of the paged runs (default: 0.25)")
    ap.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS),
                    help="resident-fold thresholds")
    ap.add_argument("--projector-thresholds", type=float, nargs="*", default=[0.5],
                    help="resident-fold thresholds run with ExFold's projectors")
    ap.add_argument("--eat-thresholds", type=float, nargs="*", default=list(EAT_THRESHOLDS))
    ap.add_argument("--exfold-pools", type=int, nargs="*", default=None,
                    help="ExFold decode pool sizes (default: 2 x top-k and 4 x top-k)")
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="timed generations per run; the median is reported")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--speed-only", action="store_true", help="skip the loss (random-weight presets)")
    ap.add_argument("--out", default=None, help="output prefix (default: bench/results/expert_modes_CHECKPOINT)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return 0
    from moestream.demo import BUILTIN_MODELS, resolve_model

    name = os.path.basename(os.path.normpath(args.checkpoint))
    ckpt = str(resolve_model(args.checkpoint)) if args.checkpoint in BUILTIN_MODELS else resolve_checkpoint(
        args.checkpoint)
    out_prefix = args.out or os.path.join(ROOT, "bench", "results", f"expert_modes_{name}")
    from moestream.models.hf_config import model_config_from_hf

    top_k = model_config_from_hf(ckpt).num_experts_per_tok
    base = dict(checkpoint=ckpt, threads=args.threads, num_seqs=args.num_seqs, seq_len=args.seq_len,
                requests=args.requests, new_tokens=args.new_tokens, speed_only=args.speed_only, rounds=args.rounds)
    tmp = tempfile.mkdtemp(prefix="expert_modes_")
    projectors = os.path.join(tmp, "exfold_projectors.safetensors")
    pools = args.exfold_pools or [2 * top_k, 4 * top_k]
    configs = [("exact", 1.0, "-", {}), ("exact", args.budget, "-", {})]
    configs += [("resident-fold", args.budget, f"t={t}", dict(resident_fold_threshold=t)) for t in args.thresholds]
    configs += [("resident-fold", args.budget, f"t={t}, projectors",
                 dict(resident_fold_threshold=t, exfold_projectors=projectors)) for t in args.projector_thresholds]
    for budget in (1.0, args.budget):  # EAT and ExFold compute fewer experts: measured resident and paged
        configs += [("eat", budget, f"lambda={t}", dict(eat_threshold=t)) for t in args.eat_thresholds]
        configs += [("exfold", budget, f"pool={p}", dict(exfold_pool_size=p, exfold_projectors=projectors))
                    for p in pools]
    if any("exfold_projectors" in c[3] for c in configs):
        subprocess.run([sys.executable, "-m", "moestream.server.cli", "calibrate", ckpt, "--dtype", "float32",
                        "--threads", str(args.threads), "--output", projectors], check=True)
    rows = []
    for mode, budget, setting, engine in configs:
        load = wait_for_idle()
        r = spawn_worker(__file__, dict(base, mode=mode, budget=budget, engine=engine))
        r.update(mode=mode, budget=budget, setting=setting, load_before=load)
        print(json.dumps(r), flush=True)
        rows.append(r)
    exact_full, exact_paged = rows[0], rows[1]
    for r in rows:
        st = r.get("final_mode_stats") or {}
        r["active_experts"] = r["top_k"] * st.get("active_fraction", 1.0)
        r["speedup_vs_paged_exact"] = exact_paged["tpot_s"] / r["tpot_s"]
        r["speedup"] = (exact_full if r["budget"] == 1.0 else exact_paged)["tpot_s"] / r["tpot_s"]
        if "loss" in r:
            r["loss_delta"] = r["loss"] - exact_full["loss"]
            r["prefill_loss_delta"] = r["prefill_loss"] - exact_full["prefill_loss"]
    with open(out_prefix + ".json", "w") as f:
        json.dump({"checkpoint": args.checkpoint, "args": vars(args), "rows": rows}, f, indent=1)
    lines = [f"`{args.checkpoint}`, float32, {args.threads} threads; loss: {args.num_seqs} held-out sequences of "
             f"{args.seq_len} tokens teacher-forced through decode; TPOT: {args.requests} requests x "
             f"{args.new_tokens} tokens", "",
             "| mode | budget | setting | activated experts/token/layer | loss delta (nats/token) | prefill loss delta | "
             "TPOT ms | "
             "speed-up over exact at the same budget | misses/token | stall ms/token | folded weight | load |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        st = r.get("final_mode_stats") or {}
        delta = f"{r['loss_delta']:+.4f}" if "loss_delta" in r else "-"
        pdelta = f"{r['prefill_loss_delta']:+.4f}" if "prefill_loss_delta" in r else "-"
        lines.append(f"| {r['mode']} | {r['budget']:.0%} | {r['setting']} | "
                     f"{r['active_experts']:.2f} | {delta} | {pdelta} | {1000 * r['tpot_s']:.2f} | "
                     f"{r['speedup']:.2f}x | {r['misses_per_token']:.2f} | "
                     f"{1000 * r['stall_per_token_s']:.2f} | {st.get('folded_fraction', 0.0):.1%} | "
                     f"{r['load_before']:.2f} |")
    write_markdown(out_prefix + ".md", lines)
    plt = pyplot()
    if plt is not None and not args.speed_only:
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, marker in (("resident-fold", "o-"), ("eat", "s-"), ("exfold", "^-")):
            for budget in (args.budget, 1.0):
                pts = [r for r in rows if r["mode"] == mode and r["budget"] == budget and "projectors" not in r["setting"]]
                if pts:
                    ax.plot([r["speedup"] for r in pts], [r["loss_delta"] for r in pts], marker,
                            label=f"{mode} at {budget:.0%}", alpha=1.0 if budget < 1 else 0.5)
                    for r in pts:
                        ax.annotate(r["setting"], (r["speedup"], r["loss_delta"]), fontsize=7)
        ax.axhline(0.05, ls=":", c="gray")
        ax.set(xlabel="TPOT speed-up over exact at the same budget", ylabel="loss delta (nats/token)",
               title=f"approximate expert modes ({args.checkpoint})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_prefix + ".png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
