"""Constraints that apply only after the reasoning ends, as vLLM does with a reasoning parser:
while a request is still thinking its tokens are free; once the output has written the
parser's end marker (`</think>`; for gpt-oss the start of a final-channel message), its
grammar masks every later token. A prompt that already ended its reasoning (a template with
thinking turned off writes `<think></think>`) is constrained from its first token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from moestream.structured_output.backend import GrammarBackend, GrammarMatcher
from moestream.structured_output.params import StructuredOutputsParams

TAIL_SLACK = 16  # characters kept besides the end marker's length
PROMPT_TAIL_TOKENS = 64  # the prompt's last tokens searched for the markers (the template's generation prompt)


class ReasoningGatedMatcher:
    """A matcher that ignores tokens, and masks nothing, until the reasoning has ended.

    Args:
        inner: the request's grammar matcher.
        decode: token id -> its text (special tokens kept).
        end: the end marker's text.
        ended: the reasoning has ended already (in the prompt).
    """

    def __init__(self, inner: GrammarMatcher, decode: Callable[[int], str], end: str, ended: bool) -> None:
        self.inner = inner
        self.ended = ended
        self._decode = decode
        self._end = end
        self._tail = ""

    @staticmethod
    def mask_rows(matchers: "Sequence[ReasoningGatedMatcher]", logits: torch.Tensor, rows: Sequence[int]) -> None:
        """Mask the rows of matchers whose reasoning has ended (see `GrammarMatcher.mask_rows`)."""
        active = [(m.inner, r) for m, r in zip(matchers, rows) if m.ended]
        if active:
            type(active[0][0]).mask_rows([m for m, _ in active], logits, [r for _, r in active])

    def accept(self, token: int) -> bool:
        """Advance past `token`: the grammar's step once the reasoning has ended, else a
        check whether the output text now holds the end marker (always True)."""
        if self.ended:
            return self.inner.accept(token)
        self._tail = (self._tail + self._decode(token))[-(len(self._end) + TAIL_SLACK):]
        self.ended = self._end in self._tail
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo accepted grammar tokens (only those after the reasoning ended)."""
        if self.ended:
            self.inner.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return self.ended and self.inner.is_terminated


class ReasoningGatedBackend:
    """A grammar backend whose matchers wait for the end of the reasoning. The markers are
    matched on text, not token ids, so that a marker the tokenizer splits in several
    ways is still found.

    Args:
        inner: the backend that compiles and matches.
        tokenizer: the model's HF tokenizer.
        parser: the reasoning parser (its `gate_markers` and `ended_in`).
    """

    def __init__(self, inner: GrammarBackend, tokenizer: Any, parser: Any) -> None:
        self.inner = inner
        self._tokenizer = tokenizer
        self._parser = parser

    def compile(self, params: StructuredOutputsParams) -> object:
        return self.inner.compile(params)

    def prefetch(self, matchers: Sequence[ReasoningGatedMatcher]) -> None:
        """Prefetch the masks of the matchers whose reasoning has ended."""
        self.inner.prefetch([m.inner for m in matchers if m.ended])

    def _decode(self, token: int) -> str:
        return self._tokenizer.decode([token], skip_special_tokens=False)

    def matcher(self, params: StructuredOutputsParams | None,
                prompt_token_ids: Sequence[int] = ()) -> ReasoningGatedMatcher | None:
        inner = self.inner.matcher(params, prompt_token_ids)
        if inner is None:
            return None
        tail = self._tokenizer.decode(list(prompt_token_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        return ReasoningGatedMatcher(inner, self._decode, self._parser.gate_markers[1], self._parser.ended_in(tail))
