"""`moestream generate [MODEL_DIR] PROMPT [PROMPT ...]`: generate completions offline and
print them with tokens/s. Imports nothing heavy until the command runs."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from moestream.demo import BUILTIN_MODELS
from moestream.engine.args import add_engine_args, engine_kwargs

if TYPE_CHECKING:
    from moestream.outputs import CompletionOutput
    from moestream.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 64

# Flags passed to SamplingParams when given (their defaults are None = not given).
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "stop_token_ids",
                  "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs")

logger = logging.getLogger(__name__)


def _positive_int(text: str) -> int:
    """An int of at least 1."""
    n = int(text) if text.isdigit() else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'")
    return n


def _token_ids(text: str) -> list[int]:
    """'2,7' -> [2, 7]."""
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 2,7, got '{text}'") from None


def add_generate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `generate` command to the subcommands `sub`; returns its parser."""
    gen = sub.add_parser(
        "generate", help="generate completions for prompts and print them",
        description="Generate a completion for each prompt (batched together) and print it with tokens/s. "
                    "The model is the first positional argument when that is an existing directory and at "
                    "least one more follows; otherwise every positional argument is a prompt (then give the "
                    "model with --model). Sampling flags not given take the model's generation_config.json "
                    "values (e.g. its repetition_penalty; see --generation-config), else SamplingParams' "
                    "defaults, except that generate is greedy (temperature 0) and stops after 64 tokens "
                    "unless told otherwise.")
    gen.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                     help="Hugging Face checkpoint directory or built-in model ('demo', 'demo-hybrid', 'demo-looped'), same as "
                          "--model: taken as the model only when it is an existing directory or a built-in name "
                          "followed by a prompt, else it is the first prompt")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="one or more prompts")
    s = gen.add_argument_group("sampling (as the HTTP API's fields)")
    s.add_argument("--max-tokens", type=int, default=None,
                   help=f"max new tokens per prompt (default: {DEFAULT_MAX_TOKENS})")
    s.add_argument("--temperature", type=float, default=None, help="sampling temperature; 0 = greedy (default: 0)")
    s.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (default: 1)")
    s.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens; 0 = off (default: 0)")
    s.add_argument("--min-p", type=float, default=None,
                   help="drop tokens below min-p x the top probability (default: 0)")
    s.add_argument("--seed", type=int, default=None,
                   help="sampling seed: the same seed gives the same output; choice i of --n uses seed + i "
                        "(default: none)")
    s.add_argument("--repetition-penalty", type=float, default=None,
                   help="penalise tokens already in the prompt or output; > 1 discourages repeats (default: the "
                        "model's generation_config.json value, else 1; the demo model's is 1.3)")
    s.add_argument("--presence-penalty", type=float, default=None,
                   help="in [-2, 2]: subtract this from the logit of every token already in the output (default: 0)")
    s.add_argument("--frequency-penalty", type=float, default=None,
                   help="in [-2, 2]: subtract this x its count from the logit of every token in the output "
                        "(default: 0)")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--stop-token-ids", type=_token_ids, action="extend", default=None, metavar="ID[,ID...]",
                   help="stop at any of these token ids, comma-separated (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", default=None,
                   help="do not stop at the end-of-sequence token (default: stop)")
    s.add_argument("--n", type=_positive_int, default=None,
                   help="completions per prompt, printed as choice 0, 1, ... (default: 1)")
    s.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print the N most likely tokens and their log-probabilities at each generated token, "
                        "after each completion (default: off)")
    gen.add_argument("--cartridge", action="append", default=None, metavar="CARTRIDGE",
                     help="a KV cartridge every prompt starts after: a .safetensors path or an id in "
                          "--cartridge-dir (repeatable: composed in order; docs/cartridges.md)")
    gen.add_argument("-v", "--verbose", action="store_true", help="log engine sizes at start-up")
    add_engine_args(gen)
    return gen


def split_model_and_prompts(model_dir: str | None, prompts: list[str]) -> tuple[str | None, list[str]]:
    """(model, prompts) of generate's positional arguments: the first is the model when it
    is an existing directory or a built-in model's name ("demo", "demo-hybrid", "demo-looped") and at least
    one more follows; otherwise all are prompts.

    Raises:
        ValueError: the first of several looks like a path (it contains '/' or starts with
            '.') but is not a directory, or is a near miss of a built-in model's name: a
            mistyped model, not a prompt.
    """
    positionals = ([] if model_dir is None else [model_dir]) + list(prompts)
    if len(positionals) > 1:
        first = positionals[0]
        if os.path.isdir(first) or first in BUILTIN_MODELS:
            return first, positionals[1:]
        close = difflib.get_close_matches(first, BUILTIN_MODELS, n=1, cutoff=0.8)
        if close and first != close[0] and not any(c.isspace() for c in first):
            raise ValueError(f"'{first}' is not a built-in model; did you mean '{close[0]}'? (give prompts only to use "
                             "the demo model)")
        if ("/" in first or first.startswith(".")) and "\n" not in first:
            raise ValueError(f"model directory '{first}' does not exist (a first argument that looks like a path "
                             "names the model); check the path, or give prompts only to use the demo model")
    return None, positionals


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """SamplingParams keyword arguments of the sampling flags given; unless given, the
    temperature is 0 (greedy) and max_tokens 64. `run_generate` lays these over the
    model's generation_config.json defaults (so those fill only the other fields)."""
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    kwargs = {k: v for k, v in given.items() if v is not None}
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    return kwargs


def choice_params(kwargs: dict[str, Any], n: int) -> list[SamplingParams]:
    """The SamplingParams of the n choices of one prompt: with a seed, choice i uses
    seed + i (as the HTTP API), so the choices differ and choice 0 equals a run with n = 1.

    Raises:
        ValueError: a field is out of range.
    """
    from moestream.sampling_params import SamplingParams

    seed = kwargs.get("seed")
    return [SamplingParams(**{**kwargs, "seed": None if seed is None else seed + i}) for i in range(n)]


def format_logprobs(completion: CompletionOutput, n: int) -> list[str]:
    """One line per generated token: the token, its logprob, then the top-n alternatives."""
    lines = []
    for token, entry in zip(completion.token_ids, completion.logprobs or []):
        chosen = entry[token]
        top = sorted((lp for lp in entry.values() if lp.rank <= n), key=lambda lp: lp.rank)[:n]
        alts = ", ".join(f"{lp.decoded_token!r} {lp.logprob:.3f}" for lp in top)
        lines.append(f"  {chosen.decoded_token!r} {chosen.logprob:.3f}" + (f" | top: {alts}" if alts else ""))
    return lines


def _generate_watching_speed(llm: Any, prompts: list[str], params: list[SamplingParams],
                             window: float = 0.5) -> tuple[list[Any], str | None]:
    """`llm.generate(prompts, params)`, also measuring the output tokens/s in windows of
    `window` seconds: when the last window ran many times slower than the best one
    (`threads.slow_step_hint`: shared, oversubscribed cores), a hint naming the thread
    count, else None."""
    import torch

    from moestream.threads import slow_step_hint

    final: dict[str, Any] = {}
    counts: dict[str, int] = {}
    best = last = 0.0
    mark, tokens = time.perf_counter(), 0
    for out in llm.generate_stream(prompts, params):
        n = len(out.outputs[0].token_ids)
        tokens += n - counts.get(out.request_id, 0)
        counts[out.request_id] = n
        if out.finished:
            final[out.request_id] = out
        now = time.perf_counter()
        if now - mark >= window:
            last = tokens / (now - mark)
            best, mark, tokens = max(best, last), now, 0
    order = sorted(final, key=lambda rid: int(rid) if rid.isdigit() else rid)  # the engine numbers them in order
    hint = slow_step_hint(last, torch.get_num_threads(), best) if last else None
    return [final[rid] for rid in order], hint


def run_generate(args: argparse.Namespace) -> int:
    """Run `moestream generate`. Returns 0, or 2 on a bad flag (an `error: ...` line).

    Raises:
        ValueError: a bad model, prompt or sampling value (main prints it).
        OSError: a file cannot be read or written.
    """
    model, prompts = split_model_and_prompts(args.model_dir, args.prompts)
    if model is not None and args.model is not None and model != args.model:
        print(f"error: MODEL_DIR '{model}' and --model '{args.model}' differ; give one", file=sys.stderr)
        return 2
    if model is not None:
        args.model = model
    kwargs = sampling_kwargs(args)
    n = args.n or 1
    from moestream.llm import LLM

    choice_params(kwargs, n)  # bad sampling values fail before the model loads
    llm = LLM(**engine_kwargs(args))
    model_defaults = llm.llm_engine.default_sampling_fields
    from_model = sorted(k for k in model_defaults if k not in kwargs)
    kwargs = {**model_defaults, **kwargs}
    params = choice_params(kwargs, n)
    shown = " ".join(f"{k}={v}" for k, v in kwargs.items() if k not in ("stop", "stop_token_ids") or v)
    print(f"--- sampling: {shown}" + (f" ({', '.join(from_model)} from the model's generation_config.json)"
                                       if from_model else ""))
    start = time.perf_counter()
    inputs = [{"prompt": p, "cartridges": args.cartridge} if args.cartridge else p for p in prompts for _ in range(n)]
    outputs, hint = _generate_watching_speed(llm, inputs, params * len(prompts))
    elapsed = time.perf_counter() - start
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    for i, prompt in enumerate(prompts):
        print(f"--- prompt: {prompt!r}")
        for j, out in enumerate(outputs[i * n:(i + 1) * n]):
            c = out.outputs[0]
            if n > 1:
                print(f"--- choice {j}")
            print(f"{out.prompt}{c.text}")
            stop = "" if c.stop_reason is None else f", stop_reason={c.stop_reason!r}"
            print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}{stop}]")
            if out.cartridges is not None:
                print(f"[after cartridges {', '.join(out.cartridges.ids)}: {out.cartridges.num_tokens} positions]")
            if args.logprobs is not None:
                print(f"--- logprobs (token logprob | top {args.logprobs}):")
                for line in format_logprobs(c, args.logprobs):
                    print(line)
    import torch

    n = torch.get_num_threads()
    print(f"--- {total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s ({n} torch thread{'s' * (n != 1)})")
    if hint is not None:
        print(f"--- {hint}")
    stats = llm.expert_stats()
    if not stats["resident"]:
        print(f"--- experts: hit rate {stats['hit_rate']:.3f} ({stats['hits']} hits, {stats['misses']} misses), "
              f"{stats['bytes_read'] / 2**20:.1f} MiB read, stalled {stats['stall_seconds']:.2f} s")
    if args.record_routing:
        llm.llm_engine.save_routing_trace()
        print(f"--- routing trace written to {args.record_routing}")
    return 0
