"""Resident-fold: an opt-in approximate expert mode for paged experts (`--expert-mode
resident-fold`) that serves a token's low-weight, non-resident routed experts from its
resident ones instead of stalling on a read.

Per MoE layer call, for the rows of requests in this mode (the others are untouched):

- a candidate is a (token, k) pair whose expert `ensure` could not serve without a disk read
  (`PagedExpertStore.available_experts`), whose routing weight is below `threshold`, and
  which is not the token's top-1 pair (so every token keeps at least one expert);
- a candidate whose expert is loaded anyway (another pair of the batch, exact or above the
  threshold, needs it) is kept: folding it would save no read;
- the rest are folded. With ExFold's calibrated projectors (`fold_projectors.py`), each
  onto the token's kept expert that best stands in for it (weight alpha * w added there);
  without, dropped, and each token's remaining weights rescaled so that they sum to what
  the router's top-k summed to ("renormalized over the resident top-k"). A token with
  nothing folded keeps the router's weights bit for bit. docs/expert_modes.md has the
  measured quality change.

Counted per engine (`stats`): routed and folded weight of the mode's rows, pairs dropped,
and misses avoided (distinct dropped experts per layer call: each would have been a read).
"""

from __future__ import annotations

import numpy as np

from moestream.experts.expert_mode import ExpertMode
from moestream.experts.fold_projectors import FoldProjectors
from moestream.experts.store import PagedExpertStore


class ResidentFold(ExpertMode):
    """The routing modifier of `SparseMoE` (`RoutingModifier`) for resident-fold; per request.

    Raises:
        ValueError: a threshold outside (0, 1].
    """

    name = "resident-fold"

    def __init__(self, store: PagedExpertStore, threshold: float, projectors: FoldProjectors | None = None) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"resident_fold_threshold must be in (0, 1], got {threshold!r}")
        super().__init__()
        self.store, self.threshold, self.projectors = store, threshold, projectors
        self.renormalize = projectors is None

    def params(self) -> dict:
        return {"threshold": self.threshold, "projectors": self.projectors is not None}

    def decide(self, layer: int, num_experts: int, rows: np.ndarray, prefill: np.ndarray, w: np.ndarray,
               e: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        available = np.zeros(num_experts + 1, dtype=bool)
        available[self.store.available_experts(layer)] = True
        top1 = w.argmax(axis=1)  # [T]
        not_top1 = np.arange(e.shape[1])[None, :] != top1[:, None]  # [T, k]
        cand = rows[:, None] & ~available[e] & (w < self.threshold) & not_top1
        loaded = np.zeros(num_experts + 1, dtype=bool)
        loaded[np.where(cand, num_experts, e)] = True  # experts read anyway
        fold = cand & ~loaded[e]  # [T, k]
        if not fold.any():
            return None
        target, alpha = np.zeros_like(e), np.zeros(e.shape, dtype=np.float32)
        if self.projectors is not None:  # onto the token's best kept expert
            t, j = np.nonzero(fold)
            allowed = np.zeros((len(t), num_experts), dtype=bool)
            kept_t, kept_j = np.nonzero(~fold[t])
            allowed[kept_t, e[t][kept_t, kept_j]] = True
            target[t, j], alpha[t, j] = self.projectors.best(layer, e[t, j], allowed)
            fold &= alpha != 0  # no projector for the expert: read as routed
        return fold, target, alpha
