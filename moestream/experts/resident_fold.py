"""Resident-fold: an opt-in approximate expert mode for paged experts (`--expert-mode
resident-fold`) that serves a token's low-weight, non-resident routed experts from its
resident ones instead of stalling on a read.

Per MoE layer call, for the rows of requests in this mode (the others are untouched):

- a candidate is a (token, k) pair whose expert `ensure` could not serve without a disk read
  (`PagedExpertStore.available_experts`), whose routing weight is below `threshold`, and
  which is not the token's top-1 pair (so every token keeps at least one expert);
- a candidate whose expert is loaded anyway (another pair of the batch, exact or above the
  threshold, needs it) is kept: folding it would save no read;
- the rest are dropped, and each token's remaining weights are rescaled so that they sum to
  what the router's top-k summed to ("renormalized over the resident top-k"). A token with
  nothing dropped keeps the router's weights bit for bit.

Without calibrated projectors (ExFold's, not built yet) the fold is plain renormalisation
over the kept experts, as a renormalised top-k router weighs its choice; docs/expert_modes.md
has the measured quality change.

Counted per engine (`stats`): routed and folded weight of the mode's rows, pairs dropped,
and misses avoided (distinct dropped experts per layer call: each would have been a read).
"""

from __future__ import annotations

import numpy as np
import torch

from moestream.experts.store import PagedExpertStore


class ResidentFold:
    """The routing modifier of `SparseMoE` (`RoutingModifier`) for resident-fold.

    `begin_step(rows)` names this step's approximate rows (rows [T] bool on the device, or
    None when no scheduled request uses the mode: then `modify` returns the router's tensors
    as they are, with no work and no host sync).

    Raises:
        ValueError: a threshold outside (0, 1].
    """

    name = "resident-fold"

    def __init__(self, store: PagedExpertStore, threshold: float) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"resident_fold_threshold must be in (0, 1], got {threshold!r}")
        self.store, self.threshold = store, threshold
        self.rows: torch.Tensor | None = None
        self.routed_weight = 0.0  # sum of the routing weights of the mode's rows
        self.folded_weight = 0.0  # of which served by other experts
        self.routed_pairs = 0  # (token, k) pairs of the mode's rows
        self.dropped_pairs = 0
        self.misses_avoided = 0

    def begin_step(self, rows: torch.Tensor | None) -> None:
        """This step's rows [T] bool in the mode, or None for none."""
        self.rows = rows

    def modify(self, layer: int, num_experts: int, weights: torch.Tensor, ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """weights [T, k] float32, ids [T, k] int64 -> (weights, ids, keep [T, k] bool or None).

        Decided on the host in numpy (a decode step's [T, k] is a few dozen pairs, where
        torch's per-op cost would exceed a small expert's read); the paged executor reads its
        counts on the host anyway."""
        if self.rows is None:
            return weights, ids, None
        rows = self.rows.cpu().numpy()  # [T] bool
        w, e = weights.detach().cpu().numpy(), ids.cpu().numpy()  # [T, k]
        available = np.zeros(num_experts + 1, dtype=bool)
        available[self.store.available_experts(layer)] = True
        top1 = w.argmax(axis=1)  # [T]
        not_top1 = np.arange(e.shape[1])[None, :] != top1[:, None]  # [T, k]
        cand = rows[:, None] & ~available[e] & (w < self.threshold) & not_top1
        loaded = np.zeros(num_experts + 1, dtype=bool)
        loaded[np.where(cand, num_experts, e)] = True  # experts read anyway
        drop = cand & ~loaded[e]  # [T, k]
        self.routed_weight += float(w[rows].sum(dtype=np.float64))
        self.routed_pairs += int(rows.sum()) * e.shape[1]
        if not drop.any():
            return weights, ids, None
        kept = np.where(drop, np.float32(0.0), w)
        scale = w.sum(axis=1, keepdims=True) / kept.sum(axis=1, keepdims=True)  # [T, 1]
        new_w = np.where(drop.any(axis=1, keepdims=True), kept * scale, w)  # rows without a drop: the router's
        new_e = np.where(drop, e[np.arange(len(e)), top1][:, None], e)
        self.folded_weight += float(w[drop].sum(dtype=np.float64))
        self.dropped_pairs += int(drop.sum())
        self.misses_avoided += len(np.unique(e[drop]))
        dev = ids.device
        return (torch.from_numpy(new_w).to(dev), torch.from_numpy(new_e).to(dev),
                torch.from_numpy(~drop).to(dev))

    def stats(self) -> dict:
        """{"mode", "threshold", "routed_weight", "folded_weight", "folded_fraction" (of the
        mode's routed weight), "routed_pairs", "dropped_pairs", "active_fraction" (of the
        routed pairs computed), "misses_avoided"}."""
        return {"mode": self.name, "threshold": self.threshold, "routed_weight": self.routed_weight,
                "folded_weight": self.folded_weight,
                "folded_fraction": self.folded_weight / self.routed_weight if self.routed_weight else 0.0,
                "routed_pairs": self.routed_pairs, "dropped_pairs": self.dropped_pairs,
                "active_fraction": 1.0 - self.dropped_pairs / self.routed_pairs if self.routed_pairs else 1.0,
                "misses_avoided": self.misses_avoided}


def cache_salt(requested: str | None, mode: ResidentFold | None) -> bytes:
    """The prefix-cache salt of a request asking for `requested` (None: the engine's mode) on
    an engine running `mode` (None: exact): b"" when the request runs exact, else the mode
    and its threshold, so that KV computed with folded experts is only reused by requests
    folding the same way."""
    if mode is None or (requested or mode.name) == "exact":
        return b""
    return f"expert_mode={mode.name};threshold={mode.threshold!r}".encode()
