"""The llguidance grammar backend (guidance-ai/llguidance; vLLM's `guidance` backend,
vllm/v1/structured_output/backend_guidance.py, is the model followed).

Chosen over xgrammar by install weight: llguidance is one 3 MB wheel with no dependencies,
where xgrammar needs triton on x86-64 Linux (hundreds of MB). Its mask costs about 10-70 us
per token on the demo model's 8,192-token vocabulary (docs/structured_outputs.md).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from moestream.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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


class GuidanceMatcher:
    """One request's grammar state: which tokens may come next.

    Args:
        matcher: an `llguidance.LLMatcher` at the start of the output.
        vocab_size: the model's logits width (may exceed the tokenizer's).
    """

    def __init__(self, llg: Any, matcher: Any, vocab_size: int, tokenizer_vocab: int) -> None:
        self._llg = llg
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._tokenizer_vocab = tokenizer_vocab
        self._bitmask = llg.torch.allocate_token_bitmask(1, tokenizer_vocab)  # [1, ceil(V / 32)] int32

    def mask_logits(self, row: torch.Tensor) -> None:
        """Set the logits of the tokens the grammar forbids next to -inf, in place.

        row: [V] float32, the model's logits of one sampling row.
        """
        self._llg.torch.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        view = row[: self._tokenizer_vocab].unsqueeze(0)  # [1, tokenizer V]
        self._llg.torch.apply_token_bitmask_inplace(view, self._bitmask)
        row[self._tokenizer_vocab:] = float("-inf")  # padding rows of the embedding: never text

    def accept(self, token: int) -> bool:
        """Advance past `token`; False when the grammar does not allow it (the state is unchanged)."""
        return bool(self._matcher.consume_token(token))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """True once the grammar is complete and only end-of-sequence may follow."""
        return bool(self._matcher.is_stopped())


class GuidanceBackend:
    """Compiles `StructuredOutputsParams` with llguidance (once per key, LRU-cached) and makes
    per-request matchers.

    Args:
        tokenizer: the model's HF tokenizer.
        vocab_size: the model's logits width.

    Raises:
        ValueError: (on first use) llguidance is not installed.
    """

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._llg: Any = None
        self._tokenizer: Any = None
        self._cache: OrderedDict[str, str] = OrderedDict()

    def _ready(self) -> Any:
        if self._llg is None:
            self._llg = _import_llguidance()
            self._tokenizer = self._llg.hf.from_tokenizer(self._hf_tokenizer, n_vocab=None)
        return self._llg

    def compile(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar of `params`, compiled and checked once per key.

        Raises:
            ValueError: a schema, regex or grammar that does not compile; the message starts
                with `structured_outputs.<kind>` and gives the compiler's reason.
        """
        llg = self._ready()
        key = params.key
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        kind = params.kind
        any_to_lark, GbnfToLarkError = llg.gbnf_to_lark.any_to_lark, llg.gbnf_to_lark.GbnfToLarkError
        flexible = not params.disable_any_whitespace
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": flexible})
            elif kind == "json_object":
                grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                                 defaults={"whitespace_flexible": flexible})
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
        self._cache[key] = grammar
        if len(self._cache) > GRAMMAR_CACHE_SIZE:
            self._cache.popitem(last=False)
        return grammar

    def matcher(self, params: StructuredOutputsParams | None) -> GuidanceMatcher | None:
        """A fresh matcher for one request (None without `params`).

        Raises:
            ValueError: as `compile`.
        """
        if params is None:
            return None
        grammar = self.compile(params)
        llg = self._llg
        return GuidanceMatcher(llg, llg.LLMatcher(self._tokenizer, grammar, log_level=1), self.vocab_size,
                               self._tokenizer.vocab_size)
