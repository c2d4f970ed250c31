"""EAT, the Expert Account Tracker (`--expert-mode eat`): an adaptive number of experts per
token from per-layer accounts of every expert's importance, kept over the routing history.

Written from the EAT paper's description (OpenReview GSLoB1myS8: "a history-aware account
of every expert's importance" per layer and "an adaptive threshold", so that a token
activates the experts that matter rather than a fixed top-k; upper layers need more experts
than lower ones). The paper's equations were not available offline, so the account, score
and threshold below are our reading, documented in docs/expert_modes.md:

Per routed-expert layer l, over the rows of requests in the mode (others are untouched):

- account a_l [E]: an exponential moving average (decay `decay`) of each expert's share of
  the layer's routed weight per call, a_l <- decay * a_l + (1 - decay) * share, starting
  uniform (1/E). sum(a_l) stays 1.
- m_l: the same average of the layer's mean top-1 routing weight (starting at the first
  call's value). A layer whose routing is flat (low top-1 weight) gets a low threshold and
  keeps more experts.
- after this call's update: pair (t, j) scores s = w[t, j] * E * a_l[e[t, j]] (its routing
  weight times its expert's importance relative to a uniform one), and is kept when it is
  the token's top-1 or s >= threshold * m_l. The kept weights are renormalised to the
  router's sum.

The accounts are engine-wide: a request's experts depend on the traffic before it (as a
tracker over the history does), so EAT is per request in its decision but not reproducible
across different traffic. Reported: activated experts per token per layer.
"""

from __future__ import annotations

import numpy as np

from moestream.experts.expert_mode import ExpertMode


class ExpertAccountTracker(ExpertMode):
    """EAT as a `RoutingModifier`; `threshold` (lambda, > 0) and `decay` (in [0, 1)).

    Raises:
        ValueError: a parameter out of range.
    """

    name = "eat"
    renormalize = True

    def __init__(self, threshold: float, decay: float) -> None:
        if not threshold > 0.0:
            raise ValueError(f"eat_threshold must be above 0, got {threshold!r}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"eat_decay must be in [0, 1), got {decay!r}")
        super().__init__()
        self.threshold, self.decay = threshold, decay
        self.accounts: dict[int, np.ndarray] = {}  # layer -> a_l [E] float64
        self.top1_mean: dict[int, float] = {}  # layer -> m_l
        self.tokens: dict[int, int] = {}  # layer -> mode tokens routed
        self.activated: dict[int, int] = {}  # layer -> pairs computed for them

    def params(self) -> dict:
        return {"threshold": self.threshold, "decay": self.decay}

    def update(self, layer: int, num_experts: int, w: np.ndarray, e: np.ndarray) -> None:
        """Fold one call's routing (w, e [n, k] of the mode's rows) into the layer's account
        and top-1 average."""
        share = np.bincount(e.ravel(), weights=w.ravel().astype(np.float64), minlength=num_experts)[:num_experts]
        total = share.sum()
        if not total > 0:  # no routed weight in this call (or a NaN): nothing to learn from it
            return
        share /= total
        a = self.accounts.get(layer)
        a = np.full(num_experts, 1.0 / num_experts) if a is None else a
        self.accounts[layer] = self.decay * a + (1.0 - self.decay) * share
        top1 = float(w.max(axis=1).astype(np.float64).mean())
        m = self.top1_mean.get(layer)
        self.top1_mean[layer] = top1 if m is None else self.decay * m + (1.0 - self.decay) * top1

    def layer_threshold(self, layer: int) -> float:
        """threshold * m_l: the score a non-top-1 pair needs."""
        return self.threshold * self.top1_mean[layer]

    def decide(self, layer: int, num_experts: int, rows: np.ndarray, prefill: np.ndarray, w: np.ndarray,
               e: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        if not rows.any():
            return None
        self.update(layer, num_experts, w[rows], e[rows])
        if layer not in self.accounts:
            return None
        score = w.astype(np.float64) * num_experts * self.accounts[layer][e]  # [T, k]
        top1 = np.arange(e.shape[1])[None, :] == w.argmax(axis=1)[:, None]
        fold = rows[:, None] & ~top1 & (score < self.layer_threshold(layer))
        n = int(rows.sum())
        self.tokens[layer] = self.tokens.get(layer, 0) + n
        self.activated[layer] = self.activated.get(layer, 0) + n * e.shape[1] - int(fold.sum())
        return fold, np.zeros_like(e), np.zeros(e.shape, dtype=np.float32)

    def stats(self) -> dict:
        """The base counters plus "activated_per_token" {layer: mean experts computed per
        token of the mode} and "activated_mean" (over layers)."""
        per_layer = {layer: self.activated[layer] / self.tokens[layer] for layer in sorted(self.tokens)}
        return {**super().stats(), "activated_per_token": per_layer,
                "activated_mean": sum(per_layer.values()) / len(per_layer) if per_layer else 0.0}
