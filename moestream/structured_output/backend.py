"""The grammar backend interface the engine uses (`GrammarBackend`, `GrammarMatcher`); a
second backend (xgrammar, outlines-core) is one file implementing these two protocols."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from moestream.structured_output.params import StructuredOutputsParams


class GrammarMatcher(Protocol):
    """One request's grammar state."""

    @staticmethod
    def mask_rows(matchers: "Sequence[GrammarMatcher]", logits: torch.Tensor, rows: Sequence[int]) -> None:
        """Set the logits of the tokens matchers[i] forbids next to -inf in row rows[i], in
        place (matchers of one backend). logits: [B, V] float32."""

    def accept(self, token: int) -> bool:
        """Advance past `token`; False (state unchanged) when the grammar forbids it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @property
    def is_terminated(self) -> bool:
        """True once the grammar is complete (only end-of-sequence may follow)."""


class GrammarBackend(Protocol):
    """Compiles constraints (cached by `StructuredOutputsParams.key`) and makes matchers."""

    def compile(self, params: StructuredOutputsParams) -> object:
        """The compiled grammar. Raises ValueError naming `structured_outputs.<kind>`."""

    def prefetch(self, matchers: "Sequence[GrammarMatcher]") -> None:
        """Start computing these matchers' next-token masks while the model runs (optional
        work ahead: `mask_rows` must give the same masks without it)."""

    def matcher(self, params: StructuredOutputsParams | None,
                prompt_token_ids: Sequence[int] = ()) -> GrammarMatcher | None:
        """A fresh matcher for one request (its prompt's token ids given); None without
        `params`."""
