"""The cartridge router (`cartridge_routing: "auto"`): attach a cartridge only to a request
that is about its document.

Cartridges++ decides per request at inference time whether a query should use the
cartridge, so that queries about something else are answered as without it. Our relevance
score is a unigram likelihood ratio, computed on the host before the request is queued (no
forward pass): with p_doc the document's token frequencies and p_bg a background text's
(add-one smoothed over the vocabulary), a query x scores

    relevance(x) = mean over its tokens t of log((1 - m) p_bg(t) + m p_doc(t)) - log p_bg(t),

with m = 0.5: the per-token loss reduction of a unigram model interpolated with the
document's over the background's alone (the query-likelihood model of retrieval, with
Jelinek-Mercer smoothing; Zhai and Lafferty 2001). A token the document lacks scores
log(1 - m), one it uses more than the background scores above 0.
The cartridge is attached when its relevance exceeds the threshold fitted at build time: the
95th percentile of the relevance of 256 background spans of 32 tokens, so that about one
off-document query in twenty gets the cartridge (what the router must avoid is changing
off-document answers). The file stores
the whole document's log ratio per token (`router.log_odds` [V] float32) and the threshold.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SPAN = 32  # tokens per span scored when fitting the threshold
MIX = 0.5  # the document's weight in the interpolated unigram model
NUM_BACKGROUND_SPANS = 256
OFF_QUANTILE = 0.95  # the threshold: this quantile of background spans' relevance


@dataclass(frozen=True)
class CartridgeRouter:
    """A cartridge's router.

    Attributes:
        log_odds: [V] float32, log((1 - m) + m p_doc(t) / p_bg(t)) per token id.
        threshold: the relevance (nats per token) above which the cartridge is attached.
    """

    log_odds: torch.Tensor
    threshold: float

    def relevance(self, token_ids: Sequence[int]) -> float:
        """Mean log ratio over `token_ids` (ids outside the vocabulary count 0)."""
        ids = torch.tensor([t for t in token_ids if 0 <= t < len(self.log_odds)], dtype=torch.int64)
        return float(self.log_odds[ids].mean()) if len(ids) else 0.0


def _log_odds(doc: Sequence[int], background: torch.Tensor, vocab_size: int) -> torch.Tensor:
    d = torch.bincount(torch.tensor(list(doc), dtype=torch.int64), minlength=vocab_size).double()
    ratio = (d / d.sum()) / (background / background.sum())
    return (MIX * ratio + (1.0 - MIX)).log().float()


def fit_router(doc: Sequence[int], background_ids: Sequence[int], vocab_size: int, seed: int = 0
               ) -> CartridgeRouter:
    """The router of document `doc` against background text `background_ids` (token ids).

    Raises:
        ValueError: a document or background shorter than 32 tokens.
    """
    if len(doc) < SPAN or len(background_ids) < SPAN:
        raise ValueError(f"the router needs a document and a background text of at least {SPAN} tokens each")
    bg = torch.bincount(torch.tensor(list(background_ids), dtype=torch.int64), minlength=vocab_size).double() + 1.0
    rng = random.Random(seed)
    full = CartridgeRouter(_log_odds(doc, bg, vocab_size), 0.0)
    off = sorted(full.relevance(background_ids[s:s + SPAN])
                 for s in (rng.randrange(0, len(background_ids) - SPAN + 1) for _ in range(NUM_BACKGROUND_SPANS)))
    return CartridgeRouter(full.log_odds, off[int(OFF_QUANTILE * (len(off) - 1))])
