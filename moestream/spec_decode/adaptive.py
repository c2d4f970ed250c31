"""Adaptive draft length: each request drafts only as many tokens as pay for themselves.

A drafted position j (1-based) is accepted only if the j - 1 before it were, so with a
per-position acceptance probability alpha it yields alpha**j expected tokens, while it always
costs the time `b` one more token adds to the verify forward. A plain decode step of N
requests costs a + b*N seconds for N tokens, tau = (a + b*N) / N per token. Position j is
worth drafting while alpha**j * tau > b, so a request drafts

    k = #{j <= K : alpha**j > b / tau}

tokens (K = num_speculative_tokens); k = 0 turns speculation off for it. This is the
expected-speedup argument of Leviathan et al. (2023, section 3.4, "choosing gamma"), with the
cost ratio measured instead of assumed:
- `StepCostModel` fits step seconds = a + b * tokens by least squares over recent steps that
  only decoded (no prefill chunk), so expert loads under a budget and wider batches are in it;
- each request's alpha is an exponential moving average over its verified positions,
  starting from the average over all requests so far. A
  request at k = 0 still gets a one-token "shadow" draft each step (for prompt lookup, free):
  the token it then samples tells whether the draft would have been accepted, so its alpha
  keeps being measured and k comes back when drafts start to match. Where a draft costs a
  forward (`draft_experts`), its measured seconds per drafted token are added to b, and a
  request at k = 0 drafts one token every 16th step instead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Before enough steps are timed: a draft token costs a fifth of a decode step's token.
_PRIOR_COST_RATIO = 0.2
_MIN_FIT_STEPS = 16
_PROBE_EVERY = 16


class StepCostModel:
    """Least-squares fit of a forward's seconds against its token count over the last
    `window` decode-only steps: seconds = a + b * tokens.

    Raises (constructor): ValueError if window < 2.
    """

    def __init__(self, window: int = 256) -> None:
        if window < 2:
            raise ValueError(f"window must be at least 2, got {window}")
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)

    def record(self, num_tokens: int, seconds: float) -> None:
        """Record one decode-only step of `num_tokens` tokens that took `seconds`."""
        self._steps.append((num_tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(a seconds, b seconds per token), or None while fewer than 16 steps or a single
        token count were seen, or the fit is not positive."""
        n = len(self._steps)
        if n < _MIN_FIT_STEPS:
            return None
        mx = sum(t for t, _ in self._steps) / n
        my = sum(s for _, s in self._steps) / n
        var = sum((t - mx) ** 2 for t, _ in self._steps)
        if var == 0:
            return None
        b = sum((t - mx) * (s - my) for t, s in self._steps) / var
        a = my - b * mx
        if a <= 0 or b < 0:
            return None
        return a, b

    def seconds_per_token(self, num_requests: int) -> float | None:
        """tau: seconds per token of a plain decode step of `num_requests` requests, or None
        without a fit."""
        fit = self.fit()
        if fit is None:
            return None
        a, b = fit
        n = max(num_requests, 1)
        return (a + b * n) / n


@dataclass
class DraftState:
    """One request's acceptance estimate, current draft length, shadow draft (n-gram) and
    steps spent at k = 0."""

    acceptance: float
    k: int
    shadow: list[int]
    steps_off: int = 0

    def probe(self) -> bool:
        """At k = 0 for a method whose drafts cost a forward: True every 16th step, when one
        token is drafted to measure acceptance again."""
        self.steps_off += 1
        return self.steps_off % _PROBE_EVERY == 0


class AdaptiveK:
    """Per-request draft lengths from measured acceptance and measured step cost.

    Args:
        max_k: num_speculative_tokens.
        initial_acceptance: alpha before anything is measured (optimistic, so that drafting
            is tried).
        smoothing: weight of each new observation in the moving average.

    Raises (constructor): ValueError on max_k < 1 or values outside (0, 1).
    """

    def __init__(self, max_k: int, initial_acceptance: float = 0.7, smoothing: float = 0.15) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be at least 1, got {max_k}")
        if not (0 < initial_acceptance < 1 and 0 < smoothing < 1):
            raise ValueError("initial_acceptance and smoothing must be in (0, 1)")
        self.max_k = max_k
        self.initial_acceptance = initial_acceptance
        self.smoothing = smoothing
        self.cost = StepCostModel()
        self.acceptance = initial_acceptance  # over all requests, moving average
        self.draft_seconds = 0.0  # per drafted token (draft passes that run a forward), moving average

    def record_draft(self, num_tokens: int, seconds: float) -> None:
        """A draft pass that produced `num_tokens` draft tokens in `seconds`."""
        if num_tokens > 0:
            per = seconds / num_tokens
            self.draft_seconds = per if self.draft_seconds == 0 else self.draft_seconds + 0.2 * (per - self.draft_seconds)

    def cost_ratio(self, num_requests: int) -> float:
        """(b + d) / tau: the seconds one more drafted token costs (b: its share of the
        verify forward, d: drafting it) over the seconds per token of a plain decode step of
        `num_requests` requests; 0.2 until 16 decode steps are timed."""
        tau = self.cost.seconds_per_token(num_requests)
        if tau is None:
            return _PRIOR_COST_RATIO
        return (self.cost.fit()[1] + self.draft_seconds) / tau

    def new_state(self) -> DraftState:
        """A new request's state: it starts from the acceptance measured over all requests
        so far (`initial_acceptance` before any), so a workload whose drafts miss does not
        pay for each new request's first rejections again."""
        return DraftState(self.acceptance, self.max_k, [])

    def observe(self, state: DraftState, num_drafts: int, num_accepted: int) -> None:
        """Fold in one verify: `num_accepted` of `num_drafts` positions accepted, then (if
        fewer) one rejection; positions after a rejection were never judged. The engine-wide
        average moves 10x slower than a request's."""
        w = self.smoothing
        for j in range(min(num_accepted + 1, num_drafts)):
            x = 1.0 if j < num_accepted else 0.0
            state.acceptance += w * (x - state.acceptance)
            self.acceptance += 0.1 * w * (x - self.acceptance)

    def choose(self, state: DraftState, num_requests: int) -> int:
        """The draft length for the request's next step, stored in `state.k` (0..max_k)."""
        ratio = self.cost_ratio(num_requests)
        k = 0
        while k < self.max_k and state.acceptance ** (k + 1) > ratio:
            k += 1
        state.k = k
        return k
