"""`moestream calibrate [MODEL] [--text FILE] [--output FILE]`: ExFold's scalar projectors
(`moestream/experts/fold_projectors.py`) from a calibration text, written beside the
checkpoint as `exfold_projectors.safetensors` (or to --output).

The text is cut into --seq-len token pieces; --num-seqs of them, picked with --seed, are
prefilled through the engine (exact mode). At each routed-expert layer a forward pre-hook
takes the layer's input, runs its router and every expert on it (in blocks of 64 tokens),
and adds the pairwise sums to that layer's `ProjectorStats` in float64. The same text,
seed and flags give the same file. The default text is the demos' training split of the
standard library (`moestream.demo.training_files`), never their held-out files.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random

from moestream.engine.args import add_engine_args, engine_kwargs

_BLOCK = 64  # tokens per all-experts pass in the hook


def add_calibrate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `calibrate` command to the subcommands `sub`; returns its parser."""
    p = sub.add_parser(
        "calibrate", help="calibrate ExFold's expert-folding projectors on a text",
        description="Compute ExFold's scalar projectors (how well each expert's output stands in for each other's, "
                    "per MoE layer) on a calibration text and write them as a small safetensors file beside the "
                    "checkpoint, where --expert-mode exfold (and resident-fold) find them.")
    p.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                   help="checkpoint directory or built-in model; same as --model (default: demo)")
    p.add_argument("--text", action="append", default=None, metavar="FILE",
                   help="calibration text file (repeatable; default: the demos' training split of the standard "
                        "library)")
    p.add_argument("--num-seqs", type=int, default=32, help="pieces of text prefilled (default: 32)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per piece (default: 256)")
    p.add_argument("--seed", type=int, default=0, help="which pieces are picked (default: 0)")
    p.add_argument("--output", default=None, metavar="FILE",
                   help="where to write (default: exfold_projectors.safetensors in the model directory)")
    add_engine_args(p)
    p.set_defaults(subparser=p)
    return p


def calibration_pieces(tokenizer, paths: list[str] | None, num_seqs: int, seq_len: int, seed: int
                       ) -> tuple[list[list[int]], str]:
    """(up to num_seqs pieces of seq_len token ids, picked with `seed` from the texts' pieces;
    the SHA-256 of the text read)."""
    from moestream.demo import training_files

    digest = hashlib.sha256()
    pieces: list[list[int]] = []
    files = paths or training_files()
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        digest.update(text.encode())
        ids = tokenizer.encode(text)
        pieces += [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
        if paths is None and len(pieces) >= 8 * num_seqs:  # the default text is large: enough to pick from
            break
    if not pieces:
        raise ValueError(f"the calibration text has no piece of {seq_len} tokens; give more text or a lower --seq-len")
    rng = random.Random(seed)
    picks = sorted(rng.sample(range(len(pieces)), min(num_seqs, len(pieces))))
    return [pieces[i] for i in picks], digest.hexdigest()


def calibrate(llm, pieces: list[list[int]]) -> dict[int, tuple]:
    """Prefill `pieces` through `llm` with the hooks on; {layer: (alpha, explained)} numpy
    [E, E] float32 each."""
    import torch

    from moestream import SamplingParams
    from moestream.experts.fold_projectors import ProjectorStats
    from moestream.layers.moe import SparseMoE

    model = llm.llm_engine.runner.model
    stats: dict[int, ProjectorStats] = {}

    def hook(module: SparseMoE, args: tuple) -> None:
        x = args[0]  # [T, H]
        st = stats.setdefault(module.layer_idx, ProjectorStats(module.num_experts))
        E = module.num_experts
        for b in range(0, len(x), _BLOCK):
            xb = x[b:b + _BLOCK]
            _, ids = module.route(xb)  # [n, k]
            routed = torch.zeros(len(xb), E, dtype=torch.bool).scatter_(1, ids.cpu(), True)
            ones = torch.ones(len(xb), 1, dtype=torch.float32, device=x.device)
            outs = [module.experts.forward(xb, ones, torch.full((len(xb), 1), e, dtype=torch.int64, device=x.device))
                    for e in range(E)]
            st.add(torch.stack(outs, 1).cpu(), routed)

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, SparseMoE)]
    try:
        with torch.no_grad():
            llm.generate([{"prompt_token_ids": p} for p in pieces],
                         SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    return {layer: tuple(t.numpy() for t in st.projectors()) for layer, st in sorted(stats.items())}


def run_calibrate(args: argparse.Namespace) -> int:
    """Run `moestream calibrate`; returns the exit status (0). Bad flags raise ValueError."""
    import numpy as np

    from moestream import LLM
    from moestream.experts.fold_projectors import FoldProjectors

    if args.num_seqs < 1 or args.seq_len < 1:
        raise ValueError("--num-seqs and --seq-len must be at least 1")
    kw = engine_kwargs(args)
    if args.model_dir is not None:
        kw["model"] = args.model_dir
    if kw.get("expert_mode", "exact") != "exact":
        raise ValueError("calibrate runs exact; drop --expert-mode")
    if kw.get("expert_budget", 1.0) != 1.0 or kw.get("record_routing"):
        raise ValueError("calibrate runs every expert on every token: run it with every expert resident (drop "
                         "--expert-budget) and without --record-routing")
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise ValueError(f"--output {args.output}: its directory does not exist")
    kw.setdefault("max_model_len", args.seq_len + 1)
    kw["enable_prefix_caching"] = False
    llm = LLM(**kw)
    output = args.output or FoldProjectors.path_for(str(llm.llm_engine.config.model))
    pieces, digest = calibration_pieces(llm.get_tokenizer(), args.text, args.num_seqs, args.seq_len, args.seed)
    layers = calibrate(llm, pieces)
    if not layers:
        raise ValueError("the model has no routed-expert layers: nothing to calibrate")
    proj = FoldProjectors({l: a for l, (a, _) in layers.items()}, {l: x for l, (_, x) in layers.items()},
                          {"num_experts": str(len(next(iter(layers.values()))[0])),
                           "tokens": str(sum(map(len, pieces))), "seed": str(args.seed), "text_sha256": digest})
    proj.save(output)
    print(f"{'layer':>5} {'best explained (mean over experts)':>36}")
    for layer, (_, explained) in layers.items():
        off = explained.copy()
        np.fill_diagonal(off, -1.0)
        print(f"{layer:>5} {float(off.max(axis=1).mean()):>36.3f}")
    print(f"wrote {output} ({sum(map(len, pieces))} tokens, {len(layers)} layers)")
    return 0
