"""Offline replay of routing traces (`moestream trace-sim`): `simulate` a trace through an
eviction policy on a pool of device slots, exactly as the paging store calls the policy, next
to Belady's optimum (`BeladyPolicy`), and print each policy's hit rate, misses and miss ratio
to Belady."""

from __future__ import annotations

import argparse
import os
from array import array
from collections.abc import Collection, Iterator, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from moestream.experts.interface import ExpertKey
from moestream.experts.policy import POLICY_NAMES, EvictionPolicy, LazyHeap, heap_victim, make_policy
from moestream.experts.trace import RoutingTrace


class BeladyPolicy(EvictionPolicy):
    """Belady's MIN (Belady 1966, "A study of replacement algorithms for a virtual-storage
    computer"): the offline optimum. Told the exact future sequence of `on_access` keys, it
    evicts the candidate whose next access is furthest away (never again = infinity; ties
    broken by smallest key).

    Next uses are precomputed in one backward pass (O(N)); a lazy max-heap of resident keys by
    next use gives the victim.

    Raises:
        ValueError: from `on_access`, when the key differs from the next one in `future` or the
            future is exhausted.
    """

    name = "belady"

    def __init__(self, future: Sequence[ExpertKey]) -> None:
        self._future = future
        n = self._never = len(future)
        self._next = array("q", bytes(8 * n))  # next index of the same key after i, or n
        upcoming: dict[ExpertKey, int] = {}
        for i in range(n - 1, -1, -1):
            key = future[i]
            self._next[i] = upcoming.get(key, n)
            upcoming[key] = i
        self._upcoming = upcoming  # key -> its next access index >= the current position
        self._pos = 0
        self._heap = LazyHeap()  # resident keys by -next use

    def on_access(self, key: ExpertKey) -> None:
        pos = self._pos
        if pos >= self._never or self._future[pos] != key:
            expected = self._future[pos] if pos < self._never else "end of future"
            raise ValueError(f"belady: access {pos} is {key}, the future says {expected}")
        nxt = self._next[pos]
        self._upcoming[key] = nxt
        self._pos = pos + 1
        if key in self._heap:
            self._heap.set(key, -nxt)

    def on_insert(self, key: ExpertKey) -> None:
        self._heap.set(key, -self._upcoming.get(key, self._never))

    def on_evict(self, key: ExpertKey) -> None:
        self._heap.discard(key)

    def victim(self, candidates: Collection[ExpertKey], current_layer: int) -> ExpertKey:
        return heap_victim(self, self._heap, candidates)




@dataclass(frozen=True)
class SimResult:
    """Replay outcome, counted per (layer, expert) key access."""

    hits: int
    misses: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)


class _Evictable(AbstractSet):
    """Live view: resident keys minus pinned keys minus the current wave's keys."""

    def __init__(self, resident: dict[ExpertKey, None], pinned: AbstractSet, wave: set[ExpertKey]) -> None:
        self._resident, self._pinned, self._wave = resident, pinned, wave

    def __contains__(self, key: object) -> bool:
        return key in self._resident and key not in self._pinned and key not in self._wave

    def __iter__(self) -> Iterator[ExpertKey]:
        return (k for k in self._resident if k not in self._pinned and k not in self._wave)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def simulate(trace: RoutingTrace, policy: EvictionPolicy, capacity: int,
             pinned: AbstractSet[ExpertKey] = frozenset()) -> SimResult:
    """Replay `trace` through `policy` on a pool of `capacity` slots shared by all layers, as
    the paging store does. `pinned` keys are inserted first (sorted) and never evicted.

    Per access (layer, experts): `policy.on_route(layer, experts, [1.0] * k)`; then per expert,
    in order: `on_access`; hit if resident, else miss: when the pool is full, evict
    `policy.victim(candidates, layer)` with candidates = resident - pinned - the current wave's
    keys (`on_evict`), then insert (`on_insert`). An access fits in one wave (all its keys
    protected) when it has at most W = capacity - len(pinned) distinct experts; otherwise it
    runs in consecutive chunks of W experts, each chunk a wave protecting only its own keys.

    Raises:
        ValueError: capacity - len(pinned) < 1. RuntimeError: the policy chose a non-candidate.
    """
    pinned = frozenset(pinned)
    room = capacity - len(pinned)
    if room < 1:
        raise ValueError(f"capacity {capacity} leaves no slot beside {len(pinned)} pinned experts")
    resident: dict[ExpertKey, None] = {}
    wave: set[ExpertKey] = set()
    evictable = _Evictable(resident, pinned, wave)
    for key in sorted(pinned):
        resident[key] = None
        policy.on_insert(key)
    on_route, on_access, on_insert, on_evict = policy.on_route, policy.on_access, policy.on_insert, policy.on_evict
    hits = misses = evictions = 0
    for layer, experts in trace:
        on_route(layer, experts, [1.0] * len(experts))
        step = room if len(set(experts)) > room else max(1, len(experts))
        for start in range(0, len(experts), step):
            keys = [(layer, e) for e in experts[start:start + step]]
            wave.clear()
            wave.update(keys)
            for key in keys:
                on_access(key)
                if key in resident:
                    hits += 1
                    continue
                misses += 1
                if len(resident) >= capacity:
                    out = policy.victim(evictable, layer)
                    if out not in evictable:
                        raise RuntimeError(f"{policy.name} chose {out}, which is not an eviction candidate")
                    del resident[out]
                    on_evict(out)
                    evictions += 1
                resident[key] = None
                on_insert(key)
    return SimResult(hits, misses, evictions)


def future_of(trace: RoutingTrace) -> list[ExpertKey]:
    """The exact `on_access` key sequence `simulate` makes for `trace` (for BeladyPolicy).
    Equal keys share one tuple object to keep long futures small."""
    shared: dict[ExpertKey, ExpertKey] = {}
    return [shared.setdefault((layer, e), (layer, e)) for layer, experts in trace for e in experts]


def _replay(job: tuple[RoutingTrace, str, int]) -> SimResult:
    trace, name, capacity = job
    policy = BeladyPolicy(future_of(trace)) if name == "belady" else make_policy(name)
    return simulate(trace, policy, capacity)


def trace_sim_main(argv: list[str] | None = None) -> int:
    """`moestream trace-sim TRACE ...`: replay a trace at several pool sizes and print, per
    size, each policy's hit rate, misses and misses over Belady's (MIN) misses (every miss is
    one expert loaded, so the ratio is also bytes loaded over the optimum's). The replay is pure Python, about 2-15 us per key
    access depending on the policy (activation slowest), so DeepSeek traces default to their
    first 200 prompts (~3M key accesses) and (policy, size) runs go to `--jobs` processes.
    Returns the exit status."""
    p = argparse.ArgumentParser(prog="moestream trace-sim",
                                description="Replay a routing trace; print hit rates, misses and the miss ratio to "
                                            "Belady's optimum per policy and pool size.")
    p.add_argument("trace", help="a moestream trace .npz or the DeepSeek prompt-routing .npz")
    p.add_argument("--format", default="auto", choices=["auto", "moestream", "deepseek"])
    p.add_argument("--cache-sizes", default="0.1,0.25,0.5",
                   help="pool sizes in slots, comma-separated; a value below 1 is a fraction of the "
                        "trace's distinct (layer, expert) keys (default: 0.1,0.25,0.5)")
    p.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated (default: all)")
    p.add_argument("--interleave", type=int, default=1, help="DeepSeek: prompts served concurrently (default: 1)")
    p.add_argument("--max-prompts", type=int, default=200,
                   help="DeepSeek: first N prompts; 0 = all 1,000 (~15M key accesses, slow) (default: 200)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: all CPUs)")
    args = p.parse_args(argv)
    policies = [s for s in args.policies.split(",") if s]
    for name in policies:
        if name not in POLICY_NAMES:
            p.error(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}")
    if args.format == "auto":
        with np.load(args.trace) as z:
            args.format = "moestream" if "offsets" in z.files else "deepseek"
    trace = (RoutingTrace.load(args.trace) if args.format == "moestream" else
             RoutingTrace.from_deepseek_npz(args.trace, args.interleave, args.max_prompts or None))
    distinct = trace.distinct_keys()
    try:
        sizes = [int(v) if v >= 1 else max(1, round(v * distinct)) for v in map(float, args.cache_sizes.split(","))]
    except ValueError:
        p.error(f"--cache-sizes: expected numbers, got {args.cache_sizes!r}")
    print(f"trace: {len(trace)} accesses, {trace.num_key_accesses} key accesses, {distinct} distinct keys")
    cols = policies + ["belady"]
    jobs = [(trace, name, cap) for cap in sizes for name in cols]
    if args.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(args.jobs, len(jobs))) as pool:
            results = list(pool.map(_replay, jobs))
    else:
        results = [_replay(job) for job in jobs]
    print(f"{'slots':>8} {'policy':>10} {'hit rate':>9} {'misses':>10} {'x belady':>9}")
    for i, cap in enumerate(sizes):
        row = results[i * len(cols):(i + 1) * len(cols)]
        best = row[-1].misses
        for name, r in zip(cols, row):
            ratio = r.misses / best if best else float("inf") if r.misses else 1.0
            print(f"{cap:>8} {name:>10} {r.hit_rate:>9.4f} {r.misses:>10} {ratio:>9.3f}")
    return 0
