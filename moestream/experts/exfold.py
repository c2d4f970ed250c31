"""ExFold (`--expert-mode exfold`): training-free expert folding. An excluded expert's
contribution is projected onto a retained one with a calibrated scalar projector
(`fold_projectors.py`, made by `moestream calibrate`), so fewer experts are computed.

Written from ExFold's description (the paper's text was not available offline):

- prefill, token-level top-K folding: a prompt token keeps its `prefill_k` heaviest routed
  experts; each other pair is folded onto the kept expert that best stands in for it
  (largest `explained`), adding alpha * w to that expert's weight. Per request.
- decode, batch-level expert-pool folding: over the decode rows of the requests in the
  mode, the pool is the `pool_size` experts of largest summed routing weight (ties: lower
  id); each pair whose expert is outside the pool is folded onto the pool expert that best
  stands in for it, so the step computes at most `pool_size` experts for those rows (plus
  any expert without a calibrated projector, which is computed as routed). This
  needs the whole batch: a request's decode output depends on the other ExFold requests
  it is batched with (exact requests are untouched and never change it).
"""

from __future__ import annotations

import numpy as np

from moestream.experts.expert_mode import ExpertMode
from moestream.experts.fold_projectors import FoldProjectors


class ExFold(ExpertMode):
    """ExFold as a `RoutingModifier`.

    Raises:
        ValueError: prefill_k or pool_size below 1.
    """

    name = "exfold"

    def __init__(self, projectors: FoldProjectors, prefill_k: int, pool_size: int) -> None:
        if prefill_k < 1 or pool_size < 1:
            raise ValueError(f"exfold_prefill_k and exfold_pool_size must be at least 1, got {prefill_k} and "
                             f"{pool_size}")
        super().__init__()
        self.projectors, self.prefill_k, self.pool_size = projectors, prefill_k, pool_size

    def params(self) -> dict:
        return {"prefill_k": self.prefill_k, "pool_size": self.pool_size}

    def decide(self, layer: int, num_experts: int, rows: np.ndarray, prefill: np.ndarray, w: np.ndarray,
               e: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        T, k = e.shape
        fold = np.zeros((T, k), dtype=bool)
        allowed = np.zeros((T, num_experts), dtype=bool)  # per row: the experts it may fold onto
        pre = rows & prefill
        if pre.any() and self.prefill_k < k:
            rank = np.empty_like(e)
            rank[np.arange(T)[:, None], np.argsort(-w, axis=1, kind="stable")] = np.arange(k)[None, :]
            fold |= pre[:, None] & (rank >= self.prefill_k)
            t, j = np.nonzero(pre[:, None] & (rank < self.prefill_k))
            allowed[t, e[t, j]] = True
        dec = rows & ~prefill
        if dec.any():
            total = np.bincount(e[dec].ravel(), weights=w[dec].ravel().astype(np.float64), minlength=num_experts)
            used = np.flatnonzero(np.bincount(e[dec].ravel(), minlength=num_experts))
            if len(used) > self.pool_size:
                order = np.lexsort((np.arange(num_experts), -total))  # heaviest first, ties lower id
                in_pool = np.zeros(num_experts, dtype=bool)
                in_pool[order[: self.pool_size]] = True
                fold |= dec[:, None] & ~in_pool[e]
                allowed[dec] = in_pool
        if not fold.any():
            return None
        target, alpha = np.zeros_like(e), np.zeros((T, k), dtype=np.float32)
        t, j = np.nonzero(fold)
        target[t, j], alpha[t, j] = self.projectors.best(layer, e[t, j], allowed[t])
        fold &= alpha != 0  # no projector (the expert was never routed in calibration): computed as routed
        return fold, target, alpha
