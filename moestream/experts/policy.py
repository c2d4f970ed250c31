"""Eviction policies for the device expert pool: who leaves when a slot is needed.

The store owns residency and pinning and calls the hooks; a policy only ranks. Each policy
tracks the resident keys it was told about (`on_insert` / `on_evict`) in an ordered dict or a
lazy heap, so `victim` costs about O(log n) rather than a scan of the pool when `candidates`
has a fast `in` (a list or tuple is copied into a set once per call). An insertion counts as a
use for recency: a prefetched key that was never accessed is as recent as its insertion.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from moestream.experts.interface import ExpertKey

_RENORM = 1e100  # inflated increments are folded back into the scores past this size
_MISSING = object()


def _as_set(candidates: Collection[ExpertKey]) -> Collection[ExpertKey]:
    """A list or tuple is copied into a set; any other collection is taken to have a fast `in`."""
    return set(candidates) if isinstance(candidates, (list, tuple)) else candidates


class LazyHeap:
    """Min-heap over keys whose priorities change: an update pushes a new entry and stale
    entries are dropped when they reach the top (lazy deletion). Membership = 'has a priority'."""

    def __init__(self) -> None:
        self._heap: list[tuple[Any, ExpertKey]] = []
        self._prio: dict[ExpertKey, Any] = {}

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._prio

    def set(self, key: ExpertKey, prio: Any) -> None:
        self._prio[key] = prio
        heapq.heappush(self._heap, (prio, key))
        if len(self._heap) > 2 * len(self._prio) + 64:  # compact stale entries
            self._heap = [(p, k) for k, p in self._prio.items()]
            heapq.heapify(self._heap)

    def discard(self, key: ExpertKey) -> None:
        self._prio.pop(key, None)

    def members(self) -> list[ExpertKey]:
        return list(self._prio)

    def top(self) -> tuple[Any, ExpertKey] | None:
        """The smallest live (priority, key), or None."""
        heap, prio = self._heap, self._prio
        while heap and prio.get(heap[0][1], _MISSING) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def min_where(self, ok: Callable[[ExpertKey], bool]) -> tuple[Any, ExpertKey] | None:
        """The smallest live (priority, key) with ok(key), or None. Live entries stay."""
        skipped = []
        while (top := self.top()) is not None and not ok(top[1]):
            skipped.append(heapq.heappop(self._heap))
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return top


def _no_candidate(policy: EvictionPolicy) -> ValueError:
    return ValueError(f"{policy.name}: no candidate is a key the policy saw inserted and not evicted")


def heap_victim(policy: EvictionPolicy, heap: LazyHeap, candidates: Collection[ExpertKey]) -> ExpertKey:
    found = heap.min_where(_as_set(candidates).__contains__)
    if found is None:
        raise _no_candidate(policy)
    return found[1]


class EvictionPolicy:
    """Base class. Hooks are called by the store (and by `trace_sim.simulate`), in this order per
    MoE layer call: `on_route` once, then per requested expert `on_access`, and for a miss
    `victim` -> `on_evict` (when the pool is full) -> `on_insert`. All hooks default to no-ops."""

    name: str = "base"

    def on_route(self, layer: int, expert_ids: Sequence[int], weights: Sequence[float]) -> None:
        """Router output of one layer for one step, before `ensure`: `weights[i]` is the router
        probability of `expert_ids[i]` summed over the batch's tokens (>= 0, unitless)."""

    def on_access(self, key: ExpertKey) -> None:
        """`ensure` asked for `key` (hit or miss), in request order."""

    def on_insert(self, key: ExpertKey) -> None:
        """`key` became resident (after a miss or a prefetch)."""

    def on_hint(self, keys: Sequence[ExpertKey]) -> None:
        """Retention hint: the next forward is expected to reuse `keys` (the full router's
        choice for speculative draft tokens, which the verify pass will route again; after
        OLED-MoE's confidence-guided retention). Policies that use it keep hinted resident
        keys until their layer next routes; the default ignores it (LFU, activation)."""

    def on_evict(self, key: ExpertKey) -> None:
        """`key` left the pool."""

    def victim(self, candidates: Collection[ExpertKey], current_layer: int) -> ExpertKey:
        """One of `candidates` (resident, evictable, never empty) to evict.

        Raises:
            ValueError: no candidate is a resident key known to the policy.
        """
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used: evicts the candidate whose last access (or insertion) is oldest.
    Recency is a total order, so there are no ties."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()  # resident keys, oldest first

    def on_access(self, key: ExpertKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_hint(self, keys: Sequence[ExpertKey]) -> None:
        """A hinted resident key counts as used now."""
        for key in keys:
            self.on_access(key)

    def on_insert(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_evict(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def victim(self, candidates: Collection[ExpertKey], current_layer: int) -> ExpertKey:
        cand = _as_set(candidates)
        for key in self._order:
            if key in cand:
                return key
        raise _no_candidate(self)


class LFUPolicy(EvictionPolicy):
    """Least frequently used with exponential aging. Each access adds 1 to the key's count;
    after every `decay_every`-th access all counts are multiplied by `decay`. Counts persist
    across evictions. Victim: lowest count, ties broken by least recent access (or insertion).

    Aging is done by growing the increment by 1/decay instead of rescaling every count (same
    order, O(1) per aging step); stored counts are renormalised when the increment grows past
    1e100.

    Raises:
        ValueError: decay not in (0, 1] or decay_every < 1.
    """

    name = "lfu"

    def __init__(self, decay: float = 0.9, decay_every: int = 256) -> None:
        if not 0.0 < decay <= 1.0 or decay_every < 1:
            raise ValueError(f"need 0 < decay <= 1 and decay_every >= 1, got {decay}, {decay_every}")
        self.decay, self.decay_every = decay, decay_every
        self._raw: dict[ExpertKey, float] = {}  # count * inc
        self._inc = 1.0
        self._stamp: dict[ExpertKey, int] = {}
        self._clock = self._accesses = 0
        self._heap = LazyHeap()  # resident keys by (raw count, stamp)

    def count(self, key: ExpertKey) -> float:
        """The key's decayed access count."""
        return self._raw.get(key, 0.0) / self._inc

    def _touch(self, key: ExpertKey, resident: bool) -> None:
        self._clock += 1
        self._stamp[key] = self._clock
        if resident:
            self._heap.set(key, (self._raw.get(key, 0.0), self._clock))

    def on_access(self, key: ExpertKey) -> None:
        self._raw[key] = self._raw.get(key, 0.0) + self._inc
        self._touch(key, key in self._heap)
        self._accesses += 1
        if self._accesses % self.decay_every == 0:
            self._inc /= self.decay
            if self._inc > _RENORM:
                self._raw = {k: v / self._inc for k, v in self._raw.items()}
                self._inc = 1.0
                for k in self._heap.members():
                    self._heap.set(k, (self._raw.get(k, 0.0), self._stamp[k]))

    def on_insert(self, key: ExpertKey) -> None:
        self._touch(key, True)

    def on_evict(self, key: ExpertKey) -> None:
        self._heap.discard(key)

    def victim(self, candidates: Collection[ExpertKey], current_layer: int) -> ExpertKey:
        return heap_victim(self, self._heap, candidates)


class ActivationAwarePolicy(EvictionPolicy):
    """Activation-aware caching after MoE-Infinity (Xue et al., arXiv 2401.14361, the expert
    activation matrix and its layer-aware cache priority).

    Score: each `on_route(layer, ...)` first multiplies the scores of all keys of that layer by
    `decay` (one aging step per layer per engine step), then adds each routed expert's router
    probability mass; each `on_access` adds 1. So score = decayed (router mass + ensure count).

    Priority of a resident key (l, e) when layer c needs a slot, with L = (largest layer index
    seen so far by any hook or as c) + 1:  priority = score(l, e) * (1 - ((l - c) mod L) / L).
    Layer c itself weighs 1, the next layers slightly less, and the layer that just ran
    ((l - c) mod L = L - 1) weighs 1/L, since it runs again only after every other layer.
    Victim: lowest priority, ties broken by least recent access (or insertion), then smallest key.

    Aging grows a per-layer increment by 1/decay (same order as rescaling, O(1)); a layer's
    scores are renormalised when its increment passes 1e100.

    Raises:
        ValueError: decay not in (0, 1].
    """

    name = "activation"

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"need 0 < decay <= 1, got {decay}")
        self.decay = decay
        self._raw: dict[ExpertKey, float] = {}  # score * inc[layer]
        self._inc: dict[int, float] = {}
        self._stamp: dict[ExpertKey, int] = {}
        self._clock = 0
        self._num_layers = 0
        self._heaps: dict[int, LazyHeap] = {}  # per layer: resident keys by (raw score, stamp)
        self._tops: dict[int, tuple[float, int, ExpertKey]] = {}  # per layer: (score, stamp, key) of its heap top
        self._dirty: set[int] = set()  # layers whose cached top is out of date

    def score(self, key: ExpertKey) -> float:
        """The key's decayed activation score (router mass + accesses)."""
        return self._raw.get(key, 0.0) / self._inc.get(key[0], 1.0)

    def _set(self, key: ExpertKey, amount: float, resident: bool) -> None:
        """Add `amount` to the key's score; (re)rank it when resident."""
        layer = key[0]
        if layer >= self._num_layers:
            self._num_layers = layer + 1
        raw = self._raw[key] = self._raw.get(key, 0.0) + amount * self._inc.setdefault(layer, 1.0)
        if resident:
            self._heaps.setdefault(layer, LazyHeap()).set(key, (raw, self._stamp.get(key, 0)))
            self._dirty.add(layer)

    def _resident(self, key: ExpertKey) -> bool:
        heap = self._heaps.get(key[0])
        return heap is not None and key in heap

    def on_route(self, layer: int, expert_ids: Sequence[int], weights: Sequence[float]) -> None:
        self._num_layers = max(self._num_layers, layer + 1)
        inc = self._inc.get(layer, 1.0) / self.decay
        if inc > _RENORM:
            for k in [k for k in self._raw if k[0] == layer]:
                self._raw[k] /= inc
            for k in self._heaps.get(layer, LazyHeap()).members():
                self._set(k, 0.0, True)
            inc = 1.0
        self._inc[layer] = inc
        self._dirty.add(layer)
        for e, w in zip(expert_ids, weights):
            key = (layer, int(e))
            self._set(key, float(w), self._resident(key))

    def on_access(self, key: ExpertKey) -> None:
        self._clock += 1
        self._stamp[key] = self._clock
        self._set(key, 1.0, self._resident(key))

    def on_insert(self, key: ExpertKey) -> None:
        self._clock += 1
        self._stamp[key] = self._clock
        self._set(key, 0.0, True)

    def on_evict(self, key: ExpertKey) -> None:
        if self._resident(key):
            self._heaps[key[0]].discard(key)
            self._dirty.add(key[0])

    def victim(self, candidates: Collection[ExpertKey], current_layer: int) -> ExpertKey:
        ok = _as_set(candidates).__contains__
        n = self._num_layers = max(self._num_layers, current_layer + 1)  # L; weights below are L * (1 - d / L)
        for layer in self._dirty:
            top = self._heaps[layer].top() if layer in self._heaps else None
            if top is None:
                self._tops.pop(layer, None)
            else:
                self._tops[layer] = (top[0][0] / self._inc[layer], top[0][1], top[1])
        self._dirty.clear()
        # Each layer's best key ignoring `candidates` (the non-candidates, pinned or needed by the
        # current wave, are few), ranked; a non-candidate is replaced when it comes first.
        best = [(sc * (n - (layer - current_layer) % n), st, key, layer)
                for layer, (sc, st, key) in self._tops.items()]
        heapq.heapify(best)
        while best:
            _, _, key, layer = heapq.heappop(best)
            if ok(key):
                return key
            found = self._heaps[layer].min_where(ok)
            if found is not None:
                (raw, stamp), key = found
                heapq.heappush(best, (raw / self._inc[layer] * (n - (layer - current_layer) % n), stamp, key, layer))
        raise _no_candidate(self)


class NextUsePolicy(EvictionPolicy):
    """Eviction by predicted next use: evicts the candidate whose next access is expected
    furthest away, an online stand-in for Belady's MIN built on what an MoE engine knows.

    - Layers run in a fixed cycle: when layer c needs a slot, layer l's next visit is
      d = ((rank(l) - rank(c) - 1) mod n) + 1 layer visits away (n layers seen so far,
      ranked by index; layer c itself is a whole cycle away).
    - Per-layer popularity: p(l, e), the chance that expert e is among a visit's experts
      of layer l, is a mix of two exponentially decayed per-visit frequencies, one fast
      (within a prompt: `fast`, weight `fast_weight`) and one slow (the workload: `slow`).
      Each `on_route(l, ...)` decays layer l's counts and adds 1 per distinct routed expert.
    - Expected next use, in layer visits (geometric in p): d + n * (1 / p - 1).

    - A retention hint (`on_hint`) sets p = 1 for its keys until their layer next routes.
    - Looped MoE (`passes` R > 1: a layer is visited R times per token, once per pass): the
      experts of a layer's last visit get p = q, the measured rate at which a visit
      re-selects the experts of the visit before, kept apart for a later pass of the same
      token (q_pass) and for the next token's first pass (q_token), since the two differ.
      Measured on the looped demo's trace it does not beat `passes=1` (docs/looped_moe.md),
      so the engine builds the policy without it.

    Victim: the largest expected next use, ties broken by smallest key. Measured on the
    DeepSeek-V2-Lite routing trace against LRU, LFU and `activation` (`moestream
    trace-sim`; docs/expert_paging.md). Router weights are not used. Scores are kept in
    dense [layers, experts] float64 arrays, so `victim` is one vectorised pass over them.

    Raises:
        ValueError: a rate not in (0, 1) or fast_weight not in [0, 1].
    """

    name = "next_use"

    def __init__(self, fast: float = 0.5, slow: float = 0.99, fast_weight: float = 0.3, passes: int = 1) -> None:
        if not (0.0 < fast < 1.0 and 0.0 < slow < 1.0 and 0.0 <= fast_weight <= 1.0):
            raise ValueError(f"need 0 < fast, slow < 1 and 0 <= fast_weight <= 1, got {fast}, {slow}, {fast_weight}")
        if passes < 1:
            raise ValueError(f"need passes >= 1, got {passes}")
        self.fast, self.slow, self.fast_weight, self.passes = fast, slow, fast_weight, passes
        self._last = np.zeros((0, 0), dtype=bool)  # [layers, experts] routed at the layer's last visit (passes > 1)
        self._visits = np.zeros(0, dtype=np.int64)  # [layers] visits so far
        self._again = np.ones(2)  # re-selected experts, [next pass, next token] (a prior of 1 in 2)
        self._offered = np.full(2, 2.0)  # experts of the visit before
        self._fast_count = np.zeros((0, 0))  # [layers, experts] decayed visits that routed e
        self._slow_count = np.zeros((0, 0))
        self._fast_visits = np.zeros(0)  # [layers] decayed visits
        self._slow_visits = np.zeros(0)
        self._resident = np.zeros((0, 0), dtype=bool)
        self._hinted = np.zeros((0, 0), dtype=bool)  # [layers, experts] retained until the layer routes
        self._layers: list[int] = []  # seen layers, ascending
        self._rank = np.zeros(0, dtype=np.int64)  # [layers] rank of a seen layer

    def _grow(self, layer: int, expert: int) -> None:
        rows, cols = self._resident.shape
        if layer < rows and expert < cols:
            return
        r, c = max(rows, layer + 1), max(cols, expert + 1)
        pad2 = ((0, r - rows), (0, c - cols))
        self._fast_count = np.pad(self._fast_count, pad2)
        self._slow_count = np.pad(self._slow_count, pad2)
        self._resident = np.pad(self._resident, pad2)
        self._hinted = np.pad(self._hinted, pad2)
        self._last = np.pad(self._last, pad2)
        self._visits = np.pad(self._visits, (0, r - rows))
        self._fast_visits = np.pad(self._fast_visits, (0, r - rows))
        self._slow_visits = np.pad(self._slow_visits, (0, r - rows))
        self._rank = np.pad(self._rank, (0, r - rows))

    def _see_layer(self, layer: int) -> None:
        if layer in self._layers:
            return
        self._grow(layer, 0)
        self._layers = sorted([*self._layers, layer])
        self._rank[self._layers] = np.arange(len(self._layers))

    def p_next(self) -> np.ndarray:
        """[layers, experts] float64: the predicted chance of each key's use at its layer's next visit."""
        pf = self._fast_count / np.maximum(self._fast_visits, 1e-300)[:, None]
        ps = self._slow_count / np.maximum(self._slow_visits, 1e-300)[:, None]
        p = self.fast_weight * pf + (1.0 - self.fast_weight) * ps
        if self.passes > 1:  # the last visit's experts: the measured re-selection rate of the next visit's kind
            q = self._again / self._offered
            next_is_token = (self._visits % self.passes == 0)[:, None]  # the next visit is a new token's first pass
            p = np.where(self._last, np.where(next_is_token, q[1], q[0]), p)
        return np.where(self._hinted, 1.0, p)

    def on_route(self, layer: int, expert_ids: Sequence[int], weights: Sequence[float]) -> None:
        self._see_layer(layer)
        ids = sorted({int(e) for e in expert_ids})
        if ids:
            self._grow(layer, ids[-1])
        self._hinted[layer] = False
        if self.passes > 1:
            kind = int(self._visits[layer] % self.passes == 0)  # 0: a later pass of the token, 1: a new token
            prev = self._last[layer]
            if self._visits[layer]:
                self._again[kind] += prev[ids].sum()
                self._offered[kind] += prev.sum()
            prev[:] = False
            prev[ids] = True
            self._visits[layer] += 1
        self._fast_count[layer] *= self.fast
        self._slow_count[layer] *= self.slow
        self._fast_visits[layer] = self._fast_visits[layer] * self.fast + 1.0
        self._slow_visits[layer] = self._slow_visits[layer] * self.slow + 1.0
        self._fast_count[layer, ids] += 1.0
        self._slow_count[layer, ids] += 1.0

    def on_insert(self, key: ExpertKey) -> None:
        self._see_layer(key[0])
        self._grow(*key)
        self._resident[key] = True

    def on_hint(self, keys: Sequence[ExpertKey]) -> None:
        for key in keys:
            self._see_layer(key[0])
            self._grow(*key)
            self._hinted[key] = True

    def on_evict(self, key: ExpertKey) -> None:
        if key[0] < self._resident.shape[0] and key[1] < self._resident.shape[1]:
            self._resident[key] = False

    def victim(self, candidates: Collection[ExpertKey], current_layer: int) -> ExpertKey:
        self._see_layer(current_layer)
        n = len(self._layers)
        rows = np.nonzero(self._resident)
        if rows[0].size == 0:
            raise _no_candidate(self)
        layers, experts = rows  # resident keys in (layer, expert) order
        dist = (self._rank[layers] - self._rank[current_layer] - 1) % n + 1  # [R] layer visits
        p = self.p_next()[layers, experts]
        eta = dist + n * (1.0 / np.maximum(p, 1e-12) - 1.0)  # [R] expected visits to next use
        cand = _as_set(candidates)
        for i in np.argsort(-eta, kind="stable"):  # furthest first; ties keep (layer, expert) order
            key = (int(layers[i]), int(experts[i]))
            if key in cand:
                return key
        raise _no_candidate(self)


POLICY_NAMES = ("lru", "lfu", "activation", "next_use")


def make_policy(name: str, **kw: Any) -> EvictionPolicy:
    """Build an online policy by name ("lru", "lfu", "activation", "next_use"); keyword
    arguments go to its constructor. (Belady's offline optimum is `trace_sim.BeladyPolicy`.)

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    classes = {"lru": LRUPolicy, "lfu": LFUPolicy, "activation": ActivationAwarePolicy, "next_use": NextUsePolicy}
    if name not in classes:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(classes)}")
    return classes[name](**kw)
