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

ExpertKey = tuple[int, int]  # (layer, expert)

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
    """Base class. Hooks are called by the store (and by `trace.simulate`), in this order per
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


POLICY_NAMES = ("lru", "lfu", "activation")


def make_policy(name: str, **kw: Any) -> EvictionPolicy:
    """Build an online policy by name ("lru", "lfu", "activation"); keyword arguments go to
    its constructor. (Belady's offline optimum is `trace_sim.BeladyPolicy`.)

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    classes = {"lru": LRUPolicy, "lfu": LFUPolicy, "activation": ActivationAwarePolicy}
    if name not in classes:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(classes)}")
    return classes[name](**kw)
