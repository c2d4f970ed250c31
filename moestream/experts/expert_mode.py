"""What every approximate expert mode shares (docs/expert_modes.md): the step's rows, the
counters every mode reports, the prefix-cache salt, and the one routine that turns a mode's
decision (drop a pair, or fold it onto another expert with a scalar) into the tensors
`SparseMoE`'s executor takes.

A mode is a `RoutingModifier` (moestream/layers/moe.py): per MoE layer call it maps the
router's (weights [T, k] float32, ids [T, k] int64) to (weights, ids, keep [T, k] bool or
None). Only the rows `begin_step` names (the requests in the mode) change; `prefill` marks
the rows that are prompt tokens (ExFold treats them apart from decode rows).
"""

from __future__ import annotations

import numpy as np
import torch


class ExpertMode:
    """Base of the approximate expert modes. Subclasses set `name`, implement
    `decide(layer, num_experts, rows [T] bool, prefill [T] bool, w [T, k] float32, e [T, k]
    int64) -> (fold [T, k] bool, target [T, k] int64, alpha [T, k] float32) | None` in numpy
    (a pair with fold set is removed and alpha * its weight is added to expert target of
    the same token; alpha 0 drops it), and `params()` (what the prefix-cache salt and
    `stats` name). With `renormalize`, a token's weights after the decision are rescaled to
    sum to what the router's top-k summed to (as a renormalised top-k router weighs its
    choice)."""

    name = "exact"
    renormalize = False

    def __init__(self) -> None:
        self.rows: np.ndarray | None = None  # [T] bool, this step's rows in the mode
        self.prefill: np.ndarray | None = None  # [T] bool, its prompt rows
        self.routed_weight = 0.0  # sum of the routing weights of the mode's rows
        self.folded_weight = 0.0  # of which served by other experts (or dropped)
        self.routed_pairs = 0  # (token, k) pairs of the mode's rows
        self.dropped_pairs = 0  # of which not computed
        self.misses_avoided = 0  # distinct experts per layer call no pair needs any more

    def begin_step(self, rows: np.ndarray | torch.Tensor | None, prefill: np.ndarray | torch.Tensor | None = None
                   ) -> None:
        """This step's rows [T] bool in the mode (None: none, and `modify` returns the
        router's tensors untouched, with no work and no host sync) and its prompt rows
        [T] bool (None: all decode; a recomputed output token counts as a prompt row), on
        the host."""
        self.rows = None if rows is None else np.asarray(rows, dtype=bool)
        self.prefill = None if rows is None else (
            np.zeros(len(self.rows), dtype=bool) if prefill is None else np.asarray(prefill, dtype=bool))

    def params(self) -> dict:
        """The mode's parameters, as `stats` and the cache salt name them."""
        return {}

    def decide(self, layer: int, num_experts: int, rows: np.ndarray, prefill: np.ndarray, w: np.ndarray,
               e: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        raise NotImplementedError

    def modify(self, layer: int, num_experts: int, weights: torch.Tensor, ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """weights [T, k] float32, ids [T, k] int64 -> (weights, ids, keep [T, k] bool or None).

        Decided on the host in numpy: a decode step's [T, k] is a few dozen pairs, where
        torch's per-op cost would exceed a small expert's read."""
        if self.rows is None:
            return weights, ids, None
        rows, prefill = self.rows, self.prefill
        w, e = weights.detach().cpu().numpy(), ids.cpu().numpy()  # [T, k]
        self.routed_weight += float(w[rows].sum(dtype=np.float64))
        self.routed_pairs += int(rows.sum()) * e.shape[1]
        decision = self.decide(layer, num_experts, rows, prefill, w, e)
        if decision is None:
            return weights, ids, None
        fold, target, alpha = decision
        fold &= rows[:, None]
        empty = (fold & (alpha == 0)).all(axis=1)  # [T]: rows that would keep no expert
        if empty.any():  # a token needs one: its heaviest pair stays as routed
            fold[empty, w[empty].argmax(axis=1)] = False
        if not fold.any():
            return weights, ids, None
        new_w, new_e, keep = apply_folds(w, e, fold, target, alpha)
        if self.renormalize:
            changed = fold.any(axis=1, keepdims=True)  # [T, 1]
            scale = w.sum(axis=1, keepdims=True) / np.where(changed, new_w.sum(axis=1, keepdims=True), 1)
            new_w = np.where(changed, new_w * scale, w).astype(np.float32)
        self.folded_weight += float(w[fold].sum(dtype=np.float64))
        self.dropped_pairs += int(keep.size - keep.sum())
        gone = np.zeros(num_experts, dtype=bool)
        gone[e[fold]] = True
        gone[new_e[keep]] = False
        self.misses_avoided += int(gone.sum())
        dev = ids.device
        return (torch.from_numpy(new_w).to(dev), torch.from_numpy(new_e).to(dev), torch.from_numpy(keep).to(dev))

    def stats(self) -> dict:
        """{"mode", the mode's params, "routed_weight", "folded_weight", "folded_fraction" (of
        the mode's routed weight), "routed_pairs", "dropped_pairs", "active_fraction" (of the
        routed pairs computed), "misses_avoided"}."""
        return {"mode": self.name, **self.params(), "routed_weight": self.routed_weight,
                "folded_weight": self.folded_weight,
                "folded_fraction": self.folded_weight / self.routed_weight if self.routed_weight else 0.0,
                "routed_pairs": self.routed_pairs, "dropped_pairs": self.dropped_pairs,
                "active_fraction": 1.0 - self.dropped_pairs / self.routed_pairs if self.routed_pairs else 1.0,
                "misses_avoided": self.misses_avoided}


def apply_folds(w: np.ndarray, e: np.ndarray, fold: np.ndarray, target: np.ndarray, alpha: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fold pairs: w [T, k] float32, e [T, k] int64, fold [T, k] bool, target [T, k] int64,
    alpha [T, k] float32 -> (weights, ids, keep), each [T, k].

    Each folded pair (t, j) becomes expert target[t, j] with weight alpha[t, j] * w[t, j]
    (alpha 0: dropped). Pairs of one token that end on the same expert are merged into the
    first of them (weights summed); the others get keep False, weight 0 and the id of an
    expert the token keeps (the store and the recorder see only experts that are computed).
    A row with nothing folded keeps the router's weights bit for bit. Every row must keep
    a pair (`ExpertMode.modify` unfolds the heaviest pair of a row that would drop all).
    """
    changed = fold.any(axis=1)  # [T]
    moved = fold & (alpha != 0)  # pairs that end on another expert
    if not moved.any():  # drops only: a router's top-k has distinct experts, so nothing merges
        keep = ~fold
        new_w = np.where(keep, w, np.float32(0.0))
        fill = e[np.arange(len(e)), keep.argmax(axis=1)]  # [T]: an expert each token keeps
        return new_w, np.where(keep, e, fill[:, None]), keep
    final = np.where(fold, target, e)  # [T, k]
    contrib = np.where(fold, alpha * w, w).astype(np.float32)  # [T, k]
    alive = ~fold | moved
    k = e.shape[1]
    dup = np.zeros_like(fold)
    for j in range(1, k):  # a later live pair on an expert an earlier live pair of the token has
        dup[:, j] = ((final[:, :j] == final[:, j:j + 1]) & alive[:, :j]).any(axis=1) & alive[:, j]
    keep = alive & ~dup
    merged = contrib
    if dup.any():
        first = np.argmax((final[:, :, None] == final[:, None, :]) & alive[:, None, :], axis=2)  # [T, k]
        merged = np.zeros_like(contrib)
        t_idx = np.repeat(np.arange(len(e)), k).reshape(-1, k)
        np.add.at(merged, (t_idx[alive], first[alive]), contrib[alive])
    new_w = np.where(changed[:, None], np.where(keep, merged, np.float32(0.0)), w).astype(np.float32)
    fill = final[np.arange(len(e)), keep.argmax(axis=1)]  # [T]: an expert each token keeps
    return new_w, np.where(keep, final, fill[:, None]), keep


def cache_salt(requested: str | None, mode: ExpertMode | None) -> bytes:
    """The prefix-cache salt of a request asking for `requested` (None: the engine's mode) on
    an engine running `mode` (None: exact): b"" when the request runs exact, else the mode
    and its parameters, so that KV computed in a mode is only reused by requests computing
    the same way."""
    if mode is None or (requested or mode.name) == "exact":
        return b""
    return ";".join([f"expert_mode={mode.name}", *(f"{k}={v!r}" for k, v in mode.params().items())]).encode()
