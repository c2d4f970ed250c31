"""The llguidance grammar backend (guidance-ai/llguidance; vLLM's `guidance` backend,
vllm/v1/structured_output/backend_guidance.py, is the model followed).

Chosen over xgrammar by install weight: llguidance is one 3 MB wheel with no dependencies,
where xgrammar needs triton on x86-64 Linux (hundreds of MB). Its mask times are in
docs/performance.md ("Structured outputs").
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from moestream.kernels.build import load_cpu_kernels
from moestream.kernels.sampling import apply_token_bitmask
from moestream.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Bit positions of a 32-bit bitmask word.
_SHIFTS = torch.arange(32, dtype=torch.int32)
# Compiled grammars kept per engine (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256


def _import_llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.gbnf_to_lark
        import llguidance.torch
    except ImportError:
        raise ValueError("structured outputs need the llguidance package: pip install llguidance") from None
    return llguidance


def _fill_each(llg: Any, matchers: list[Any], bitmask: torch.Tensor) -> None:
    """(prefetch thread) Fill row i of `bitmask` with matchers[i]'s mask, one after the
    other on this thread: the forward pass keeps the other cores."""
    for i, m in enumerate(matchers):
        llg.torch.fill_next_token_bitmask(m, bitmask, i)


@dataclass(frozen=True)
class _Prefetch:
    """A mask being computed: row `row` of `bitmask`, of the matcher's state `version`."""

    future: concurrent.futures.Future
    bitmask: torch.Tensor
    row: int
    version: int


class GuidanceMatcher:
    """One request's grammar state: which tokens may come next.

    Args:
        matcher: an `llguidance.LLMatcher` at the start of the output.
        vocab_size: the model's logits width (may exceed the tokenizer's).
    """

    def __init__(self, llg: Any, matcher: Any, vocab_size: int, tokenizer_vocab: int, executor: Any) -> None:
        self._llg = llg
        self._executor = executor  # the backend's llguidance thread pool (batched masks)
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._tokenizer_vocab = tokenizer_vocab
        self._version = 0  # tokens accepted or rolled back so far: which state a prefetched mask is of
        self._pending: _Prefetch | None = None

    def _settle(self) -> None:
        """Wait for a mask being computed from this state (before the state changes)."""
        if self._pending is not None:
            self._pending.future.result()
            self._pending = None

    @staticmethod
    def mask_rows(matchers: "Sequence[GuidanceMatcher]", logits: torch.Tensor, rows: Sequence[int]) -> None:
        """Set to -inf, in place, the logits of the tokens each matcher's grammar forbids next
        (and every logit past the tokenizer's vocabulary) in its row. The masks are computed
        in one call by llguidance's executor (its threads, the GIL released), then applied by
        the CPU bitmask kernel, or in torch without it.

        logits: [B, V] float32; rows[i]: matchers[i]'s row.
        """
        if not matchers:
            return
        first = matchers[0]
        llg, vocab = first._llg, first._tokenizer_vocab
        pending = [m._pending for m in matchers]
        if all(p is not None and p.version == m._version and p.bitmask is pending[0].bitmask
               for p, m in zip(pending, matchers)):  # computed during the forward pass (`prefetch`)
            pending[0].future.result()
            picks = [p.row for p in pending]
            whole = picks == list(range(pending[0].bitmask.shape[0]))
            bitmask = pending[0].bitmask if whole else pending[0].bitmask[picks]
        else:
            for m in matchers:
                m._settle()
            bitmask = llg.torch.allocate_token_bitmask(len(matchers), vocab)  # [R, ceil(V_tok / 32)] int32
            llg.torch.fill_next_token_bitmask_par(first._executor, [(m._matcher, i) for i, m in enumerate(matchers)],
                                                  bitmask)
        for m in matchers:
            m._pending = None
        index = torch.tensor(list(rows), dtype=torch.long)
        if logits.device.type == "cpu" and load_cpu_kernels():  # in place, a word of 32 tokens at a time
            apply_token_bitmask(logits, bitmask, index, vocab)
            return
        allowed = ((bitmask[:, :, None] >> _SHIFTS) & 1).bool().flatten(1)[:, :vocab]  # [R, V_tok]
        index = index.to(logits.device)
        part = logits.index_select(0, index)  # [R, V]
        part[:, :vocab].masked_fill_(~allowed.to(logits.device), float("-inf"))
        part[:, vocab:] = float("-inf")
        logits.index_copy_(0, index, part)

    def accept(self, token: int) -> bool:
        """Advance past `token`; False when the grammar does not allow it (the state is unchanged)."""
        self._settle()
        ok = bool(self._matcher.consume_token(token))
        self._version += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        self._settle()
        self._matcher.rollback(num_tokens)
        self._version += 1

    @property
    def is_terminated(self) -> bool:
        """True once the grammar is complete and only end-of-sequence may follow."""
        return bool(self._matcher.is_stopped())


class GuidanceBackend:
    """Compiles `StructuredOutputsParams` with llguidance (once per key, LRU-cached) and makes
    per-request matchers.

    The server compiles on its tokenizer thread and the engine thread then finds the grammar
    cached: the cache is guarded by a lock, a compile is not (two threads may compile one key).

    Args:
        tokenizer: the model's HF tokenizer.
        vocab_size: the model's logits width.
        disable_any_whitespace: every JSON constraint compact (the engine's
            `structured_outputs_config`), whatever the request says.

    Raises:
        ValueError: (on first use) llguidance is not installed.
    """

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", vocab_size: int,
                 disable_any_whitespace: bool = False) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.disable_any_whitespace = disable_any_whitespace
        self._llg: Any = None
        self._tokenizer: Any = None
        self._executor: Any = None
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._prefetch_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _ready(self) -> Any:
        with self._lock:
            if self._llg is None:
                llg = _import_llguidance()
                self._tokenizer = llg.hf.from_tokenizer(self._hf_tokenizer, n_vocab=None)
                # llguidance's first mask sets up its token trie (seconds on a large vocabulary):
                # pay it here, where the server compiles (its tokenizer thread), not in a step
                warm = llg.LLMatcher(self._tokenizer, llg.LLMatcher.grammar_from_regex("a"), log_level=1)
                llg.torch.fill_next_token_bitmask(warm, llg.torch.allocate_token_bitmask(1, self._tokenizer.vocab_size), 0)
                self._executor = llg.LLExecutor()
                self._llg = llg
        return self._llg

    def compile(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar of `params`, compiled and checked once per key.

        Raises:
            ValueError: a schema, regex or grammar that does not compile; the message starts
                with `structured_outputs.<kind>` and gives the compiler's reason.
        """
        llg = self._ready()
        if self.disable_any_whitespace and not params.disable_any_whitespace:
            params = replace(params, disable_any_whitespace=True)
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        kind = params.kind
        any_to_lark, GbnfToLarkError = llg.gbnf_to_lark.any_to_lark, llg.gbnf_to_lark.GbnfToLarkError
        # JSON layout: compact, any whitespace, or whitespace matching the request's pattern
        ws = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None and not params.disable_any_whitespace:
            ws = {"whitespace_pattern": params.whitespace_pattern}
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=ws)
            elif kind == "json_object":
                grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=ws)
            elif kind == "structural_tag":  # free text with JSON-schema segments opened by triggers
                spec = params.structural_tag_spec()
                tags = [llg.StructTag(trigger=next(t for t in spec["triggers"] if s["begin"].startswith(t)),
                                      begin=s["begin"], grammar={**s["schema"], "x-guidance": ws}
                                      if isinstance(s["schema"], dict) else s["schema"], end=s["end"])
                        for s in spec["structures"]]
                # a trigger written <...> is one special token if the tokenizer has it as one
                added = self._hf_tokenizer.get_added_vocab()
                special = all(t in added for t in spec["triggers"] if re.fullmatch(r"<[^<>]*>", t))
                grammar = llg.LLMatcher.grammar_from_lark(llg.StructTag.to_grammar(tags, assume_special=special))
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(params.regex)
            elif kind == "choice":
                grammar = llg.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in params.choice))
            else:
                grammar = llg.LLMatcher.grammar_from_lark(any_to_lark(params.grammar))  # Lark as is, GBNF converted
        except (ValueError, TypeError, RuntimeError, GbnfToLarkError) as e:
            raise ValueError(f"structured_outputs.{kind} does not compile: {e}") from None
        error = llg.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{kind} does not compile: {' '.join(error.split())[:500]}")
        with self._lock:
            self._cache[key] = grammar
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def prefetch(self, matchers: Sequence[GuidanceMatcher]) -> None:
        """Start computing the next-token masks of `matchers` on a background thread, so that
        they are ready when the step samples (the model's forward pass runs meanwhile, on
        other cores). `mask_rows` uses them while the matcher has not moved; a matcher's
        `accept` or `rollback` first waits for its mask."""
        matchers = [m for m in matchers if m._pending is None]
        if not matchers:
            return
        llg = self._llg
        if self._prefetch_pool is None:
            self._prefetch_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moestream-grammar-mask")
        bitmask = llg.torch.allocate_token_bitmask(len(matchers), self._tokenizer.vocab_size)
        future = self._prefetch_pool.submit(_fill_each, llg, [m._matcher for m in matchers], bitmask)
        for i, m in enumerate(matchers):
            m._pending = _Prefetch(future, bitmask, i, m._version)

    def matcher(self, params: StructuredOutputsParams | None,
                prompt_token_ids: Sequence[int] = ()) -> GuidanceMatcher | None:
        """A fresh matcher for one request (None without `params`); `prompt_token_ids`
        are not used.

        Raises:
            ValueError: as `compile`.
        """
        if params is None:
            return None
        grammar = self.compile(params)
        llg = self._llg
        return GuidanceMatcher(llg, llg.LLMatcher(self._tokenizer, grammar, log_level=1), self.vocab_size,
                               self._tokenizer.vocab_size, self._executor)
