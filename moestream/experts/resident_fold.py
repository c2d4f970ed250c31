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
        """weights [T, k] float32, ids [T, k] int64 -> (weights, ids, keep [T, k] bool or None)."""
        rows = self.rows
        if rows is None:
            return weights, ids, None
        dev = ids.device
        available = torch.zeros(num_experts, dtype=torch.bool, device=dev)
        have = self.store.available_experts(layer)
        if have:
            available[torch.tensor(have, dtype=torch.int64, device=dev)] = True
        top1 = weights.argmax(dim=1, keepdim=True)  # [T, 1]
        not_top1 = torch.arange(ids.shape[1], device=dev)[None, :] != top1  # [T, k]
        cand = rows[:, None] & ~available[ids] & (weights < self.threshold) & not_top1
        loaded = torch.zeros(num_experts + 1, dtype=torch.bool, device=dev)
        loaded[ids.masked_fill(cand, num_experts).flatten()] = True  # experts read anyway
        drop = cand & ~loaded[ids]  # [T, k]
        self.routed_weight += float(weights[rows].sum())
        self.routed_pairs += int(rows.sum()) * ids.shape[1]
        if not bool(drop.any()):
            return weights, ids, None
        kept = weights.masked_fill(drop, 0.0)
        scale = weights.sum(dim=1, keepdim=True) / kept.sum(dim=1, keepdim=True)  # [T, 1]
        new_weights = torch.where(drop.any(dim=1, keepdim=True), kept * scale, weights)
        new_ids = torch.where(drop, ids.gather(1, top1).expand_as(ids), ids)
        self.folded_weight += float(weights[drop].sum())
        self.dropped_pairs += int(drop.sum())
        self.misses_avoided += int(torch.unique(ids[drop]).numel())
        return new_weights, new_ids, ~drop

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
