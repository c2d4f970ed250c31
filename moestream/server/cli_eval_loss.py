"""`moestream eval-loss [MODEL] [--text FILE] [--expert-mode MODE] [--path decode|prefill]
[engine flags]`: the teacher-forced loss of a text through the engine's own decode path (or
its prefill path), in exact mode and, when one is given, in an approximate expert mode,
printed side by side with the delta.

Teacher forcing through decode (as tests/test_demo_model.py holds the demos to their bound):
each sequence starts from its first token, and a logits processor records the log-probability
of the text's next token from the raw logits, then forces that token. All sequences decode
together, so the MoE layers see decode-sized batches and paging behaves as in serving. The
default text is the demos' held-out standard-library files (`moestream.demo.heldout_files`),
one sequence per file. `--path prefill` scores each sequence as one prompt instead, from its
prompt logprobs (`prefill_loss`): the path ExFold's prefill folding acts on. Imports nothing
heavy until the command runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
from typing import Any

from moestream.engine.args import add_engine_args, engine_kwargs


def add_eval_loss_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `eval-loss` command to the subcommands `sub`; returns its parser."""
    p = sub.add_parser(
        "eval-loss", help="teacher-forced loss of a text, exact and with an approximate expert mode",
        description="Teacher-forced loss (nats/token) of a text through the engine's decode path: once in exact "
                    "mode and, with --expert-mode, once in that mode (each on a fresh engine with the same flags), "
                    "printed side by side with the delta and the expert-cache figures.")
    p.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                   help="checkpoint directory or built-in model; same as --model (default: demo)")
    p.add_argument("--text", action="append", default=None, metavar="FILE",
                   help="a text file to score, one sequence per file (repeatable; default: the demos' held-out "
                        "standard-library files)")
    p.add_argument("--num-seqs", type=int, default=16, help="sequences scored together (default: 16)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence, at most (default: 256)")
    p.add_argument("--path", choices=("decode", "prefill"), default="decode",
                   help="score through decode (teacher forcing, the default) or through prefill (prompt logprobs)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results to FILE as JSON")
    add_engine_args(p)
    p.set_defaults(subparser=p)
    return p


def _texts(paths: list[str] | None, n: int) -> list[str]:
    from moestream.demo import heldout_files

    out = []
    for path in paths or heldout_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            out.append(f.read())
        if len(out) == n:
            break
    return out


def teacher_forced_loss(llm: Any, sequences: list[list[int]]) -> dict:
    """Score `sequences` (token ids, each at least 2) together through `llm`'s decode path:
    {"tokens": scored tokens, "loss": mean negative log-likelihood (nats/token), "seconds",
    "expert": llm.expert_stats()}.

    Raises:
        RuntimeError: the engine did not follow the forced tokens (a bug).
    """
    from moestream import SamplingParams

    nll: list[float] = []

    def teacher(seq: list[int]):
        import torch

        def force(out_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            target = seq[1 + len(out_ids)]
            nll.append(-float(torch.log_softmax(logits, -1)[target]))
            forced = torch.full_like(logits, float("-inf"))
            forced[target] = 0.0
            return forced

        return force

    params = [SamplingParams(temperature=0, max_tokens=len(s) - 1, ignore_eos=True, logits_processors=[teacher(s)])
              for s in sequences]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": s[:1]} for s in sequences], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    for s, o in zip(sequences, outs):
        if list(o.outputs[0].token_ids) != s[1:]:
            raise RuntimeError("the engine did not follow the forced tokens")
    return {"tokens": len(nll), "loss": sum(nll) / len(nll), "seconds": seconds, "expert": llm.expert_stats()}


def prefill_loss(llm: Any, sequences: list[list[int]]) -> dict:
    """Score `sequences` (token ids, each at least 2) as prompts, from their prompt logprobs
    (the prefill path): the same keys as `teacher_forced_loss`."""
    from moestream import SamplingParams

    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    seconds = time.perf_counter() - t0
    nll = [-o.prompt_logprobs[i][t].logprob for o, s in zip(outs, sequences) for i, t in enumerate(s) if i > 0]
    return {"tokens": len(nll), "loss": sum(nll) / len(nll), "seconds": seconds, "expert": llm.expert_stats()}


def run_eval_loss(args: argparse.Namespace) -> int:
    """Run `moestream eval-loss`; returns the exit status (0). Bad flags raise ValueError."""
    from moestream import LLM

    if args.num_seqs < 1 or args.seq_len < 2:
        raise ValueError("--num-seqs must be at least 1 and --seq-len at least 2")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ValueError(f"--json {args.json}: its directory does not exist")
    kw = engine_kwargs(args)
    if args.model_dir is not None:
        kw["model"] = args.model_dir
    mode = kw.pop("expert_mode", "exact")
    # decode: a sequence is its first token and seq_len - 1 forced ones; prefill: a prompt and one sampled token
    need = args.seq_len + (args.path == "prefill")
    kw.setdefault("max_model_len", need)
    if kw["max_model_len"] < need:
        raise ValueError(f"--seq-len {args.seq_len} needs --max-model-len of at least {need} "
                         f"(got {kw['max_model_len']}); lower --seq-len or raise --max-model-len")
    results: dict[str, dict] = {}
    sequences: list[list[int]] | None = None
    for name in ["exact"] + ([mode] if mode != "exact" else []):
        llm = LLM(**kw, expert_mode=name)
        if sequences is None:
            tok = llm.get_tokenizer()
            sequences = [ids[:args.seq_len] for ids in (tok.encode(t) for t in _texts(args.text, args.num_seqs))]
            sequences = [s for s in sequences if len(s) >= 2]
            if not sequences:
                raise ValueError("no text of at least 2 tokens to score")
        results[name] = (prefill_loss if args.path == "prefill" else teacher_forced_loss)(llm, sequences)
        del llm
        gc.collect()
    _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _print(results: dict[str, dict]) -> None:
    base = results["exact"]["loss"]
    print(f"{'mode':<14} {'tokens':>7} {'loss':>8} {'delta':>9} {'ppl':>8} {'misses/tok':>10} {'stall s':>8} "
          f"{'tok/s':>7}")
    for name, r in results.items():
        e = r["expert"]
        print(f"{name:<14} {r['tokens']:>7} {r['loss']:>8.4f} {r['loss'] - base:>+9.4f} {math.exp(r['loss']):>8.2f} "
              f"{e.get('misses', 0) / r['tokens']:>10.2f} {e.get('stall_seconds', 0.0):>8.2f} "
              f"{r['tokens'] / r['seconds']:>7.1f}")
        if name != "exact" and "expert_mode" not in r["expert"]:
            print(f"  {name}: every expert is resident (no --expert-budget below 1), so it never acted")
        if "expert_mode" in r["expert"]:
            m = r["expert"]["expert_mode"]
            print(f"  {name}: {m['folded_fraction']:.1%} of the routed weight folded, {m['dropped_pairs']} of "
                  f"{m['routed_pairs']} (token, expert) pairs not computed, {m['misses_avoided']} expert loads "
                  f"avoided")
            if "activated_mean" in m:
                print(f"  {name}: experts per token by layer: "
                      + " ".join(f"{layer}:{v:.2f}" for layer, v in m["activated_per_token"].items()))
