"""Eviction policies: exact eviction orders, decay bookkeeping against literal reference
implementations, and Belady against a brute-force optimum."""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from functools import cache

import pytest

from moestream.experts.policy import (
    POLICY_NAMES,
    ActivationAwarePolicy,
    EvictionPolicy,
    ExpertKey,
    LFUPolicy,
    LRUPolicy,
    NextUsePolicy,
    make_policy,
)
from moestream.experts.trace import RoutingTrace
from moestream.experts.trace_sim import BeladyPolicy, future_of, simulate

A, B, C, D = (0, 0), (0, 1), (0, 2), (0, 3)


def evictions(policy: EvictionPolicy, accesses: list[tuple[int, tuple[int, ...]]], capacity: int) -> list[ExpertKey]:
    """The keys `simulate` evicts, in order."""
    out: list[ExpertKey] = []
    inner = policy.on_evict
    policy.on_evict = lambda key: (out.append(key), inner(key))  # type: ignore[method-assign]
    simulate(RoutingTrace.from_accesses(accesses), policy, capacity)
    return out


def one_layer(*experts: int) -> list[tuple[int, tuple[int, ...]]]:
    return [(0, (e,)) for e in experts]


def test_lru_order() -> None:
    p = LRUPolicy()
    for k in (A, B, C):
        p.on_access(k)
        p.on_insert(k)
    p.on_access(A)  # recency: B, C, A
    assert p.victim([A, B, C], 0) == B
    assert p.victim([A, C], 0) == C
    p.on_evict(B)
    p.on_insert(D)  # an insertion counts as a use: C, A, D
    assert p.victim([A, C, D], 0) == C
    assert evictions(LRUPolicy(), one_layer(0, 1, 0, 2, 1, 3, 0), 2) == [B, A, C, B]


def test_lfu_order_and_ties() -> None:
    # counts persist across evictions: b returns with count 2 and outlives c (count 1); then
    # c returns (2) and a (2, older) goes; then d comes and b (2, older than c) goes
    assert evictions(LFUPolicy(decay_every=1000), one_layer(0, 0, 1, 2, 1, 2, 3), 2) == [B, C, A, B]
    # equal counts: least recent access goes first
    assert evictions(LFUPolicy(), one_layer(0, 1, 2, 3), 2) == [A, B]


def test_lfu_decay() -> None:
    p = LFUPolicy(decay=0.5, decay_every=2)
    p.on_access(A)
    p.on_access(A)  # 2 -> decayed to 1
    assert p.count(A) == 1.0
    p.on_access(B)
    p.on_access(B)  # a 1 -> 0.5, b 2 -> 1
    assert (p.count(A), p.count(B)) == (0.5, 1.0)
    p = LFUPolicy(decay=0.5, decay_every=1)
    for _ in range(400):  # c <- (c + 1) / 2 tends to 1; the increment passes 1e100 and is folded back
        p.on_access(A)
    assert p.count(A) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        LFUPolicy(decay=0.0)
    with pytest.raises(ValueError):
        LFUPolicy(decay_every=0)


def test_activation_priority() -> None:
    p = ActivationAwarePolicy(decay=0.5)
    for layer, experts, weights in ((0, [0, 1], [3.0, 1.0]), (1, [0], [2.0])):
        p.on_route(layer, experts, weights)
        for e in experts:
            p.on_access((layer, e))
            p.on_insert((layer, e))
    assert [p.score(k) for k in ((0, 0), (0, 1), (1, 0))] == [4.0, 2.0, 3.0]  # mass + 1 access
    # current layer 2, L = 3: layer 0 weighs 1 - 1/3, layer 1 (just ran) 1 - 2/3
    # priorities: (0,0) 8/3, (0,1) 4/3, (1,0) 1
    assert p.victim([(0, 0), (0, 1), (1, 0)], 2) == (1, 0)
    assert p.victim([(0, 0), (0, 1)], 2) == (0, 1)
    p.on_route(0, [], [])  # layer 0 ages: (0,0) 2, (0,1) 1
    assert (p.score((0, 0)), p.score((0, 1))) == (2.0, 1.0)
    # current layer 0: layer 0 weighs 1, layer 1 weighs 2/3: (1,0) 2, (0,1) 1
    assert p.victim([(0, 0), (0, 1), (1, 0)], 0) == (0, 1)
    for _ in range(400):  # layer 0 ages far past the renormalisation point: s <- s / 2 + mass
        p.on_route(0, [0], [1.0])
    assert p.score((0, 0)) == pytest.approx(2.0) and 0.0 <= p.score((0, 1)) < 1e-100
    assert p.victim([(0, 0), (0, 1), (1, 0)], 0) == (0, 1)
    assert p.victim([(0, 0), (1, 0)], 0) == (0, 0)  # tie (2 * 3 = 3 * 2): older access goes
    p.on_insert((2, 5))  # prefetched, never routed: score 0
    assert p.victim([(0, 0), (0, 1), (1, 0), (2, 5)], 0) == (2, 5)


def test_belady_order_and_errors() -> None:
    accesses = one_layer(0, 1, 2, 0, 3, 1, 0)
    # at 2: a next at 3, b at 5 -> b; at 3: a at 6, c never -> c; at b: a at 6, d never -> d
    assert evictions(BeladyPolicy(future_of(RoutingTrace.from_accesses(accesses))), accesses, 2) == [B, C, D]
    # never again for both: the smaller key goes
    accesses = one_layer(2, 1, 3)
    assert evictions(BeladyPolicy(future_of(RoutingTrace.from_accesses(accesses))), accesses, 2) == [B]
    p = BeladyPolicy([A, B])
    p.on_access(A)
    with pytest.raises(ValueError, match="future"):
        p.on_access(C)
    p.on_access(B)
    with pytest.raises(ValueError):
        p.on_access(A)


def test_next_use_order() -> None:
    # one layer: the next visit is always 1 away, so the key least likely to be routed goes.
    # After 0, 0, 1, 2 the predicted chance of A is 0.3 * 0.375 / 1.875 + 0.7 * 1.995 / 3.994
    # (0.41) against B's 0.3 * 0.5 / 1.875 + 0.7 * 0.999 / 3.994 (0.26): B goes, where LRU
    # evicts A (and then hits B); then B returns and C (0.22) goes before A (0.31).
    assert evictions(NextUsePolicy(slow=0.999), one_layer(0, 0, 1, 2, 1), 2) == [B, C]
    assert evictions(LRUPolicy(), one_layer(0, 0, 1, 2, 1), 2) == [A]
    # equal chances: the key whose layer runs last in the cycle goes; layer 1 needing a slot
    # puts its own layer a whole cycle away (3 layers: 0 is 2 visits away, 2 is 1, 1 is 3)
    p = NextUsePolicy()
    for layer in (0, 1, 2):
        p.on_route(layer, [0], [1.0])
        p.on_insert((layer, 0))
    assert p.victim([(0, 0), (1, 0), (2, 0)], 1) == (1, 0)
    assert p.victim([(0, 0), (2, 0)], 1) == (0, 0)
    assert p.victim([(0, 0), (2, 0)], 2) == (2, 0)
    with pytest.raises(ValueError, match="fast"):
        NextUsePolicy(fast=1.0)


def test_retention_hints() -> None:
    # next_use: a hinted key counts as certain (p = 1) until its layer routes again
    p = NextUsePolicy()
    for e in (0, 0, 0, 1):  # A is routed 3 times, B once
        p.on_route(0, [e], [1.0])
    p.on_insert(A)
    p.on_insert(B)
    assert p.victim([A, B], 0) == B
    p.on_hint([B])
    assert p.victim([A, B], 0) == A
    p.on_route(0, [2], [1.0])  # the layer ran: the hint is spent
    assert p.victim([A, B], 0) == B
    # lru: a hinted resident key is as recent as an access; an unknown one is ignored
    q = LRUPolicy()
    for k in (A, B, C):
        q.on_insert(k)
    q.on_hint([A, D])
    assert q.victim([A, B, C], 0) == B and q.victim([A, C], 0) == C


def test_victim_rejects_unknown_candidates() -> None:
    for policy in (LRUPolicy(), LFUPolicy(), ActivationAwarePolicy(), NextUsePolicy(), BeladyPolicy([A])):
        policy.on_insert(A)
        with pytest.raises(ValueError):
            policy.victim([B], 0)


def test_make_policy() -> None:
    assert POLICY_NAMES == ("lru", "lfu", "activation", "next_use")
    assert [type(make_policy(n)) for n in POLICY_NAMES] == [LRUPolicy, LFUPolicy, ActivationAwarePolicy, NextUsePolicy]
    assert make_policy("lfu", decay=0.5).decay == 0.5
    with pytest.raises(ValueError, match="valid: lru, lfu, activation, next_use$"):
        make_policy("fifo")


class LiteralLFU(EvictionPolicy):
    """Reference: rescales every count in place."""

    name = "literal-lfu"

    def __init__(self, decay: float, every: int) -> None:
        self.decay, self.every, self.n, self.clock = decay, every, 0, 0
        self.count: dict[ExpertKey, float] = {}
        self.stamp: dict[ExpertKey, int] = {}

    def on_access(self, key: ExpertKey) -> None:
        self.count[key] = self.count.get(key, 0.0) + 1.0
        self.clock += 1
        self.stamp[key] = self.clock
        self.n += 1
        if self.n % self.every == 0:
            self.count = {k: v * self.decay for k, v in self.count.items()}

    def on_insert(self, key: ExpertKey) -> None:
        self.clock += 1
        self.stamp[key] = self.clock

    def victim(self, candidates: Collection[ExpertKey], current_layer: int) -> ExpertKey:
        return min(candidates, key=lambda k: (self.count.get(k, 0.0), self.stamp[k]))


class LiteralActivation(EvictionPolicy):
    """Reference: ages every score of the routed layer in place; priority score * (L - d)."""

    name = "literal-activation"

    def __init__(self, decay: float) -> None:
        self.decay, self.clock, self.layers = decay, 0, 0
        self.score: dict[ExpertKey, float] = {}
        self.stamp: dict[ExpertKey, int] = {}

    def on_route(self, layer: int, expert_ids: Sequence[int], weights: Sequence[float]) -> None:
        self.layers = max(self.layers, layer + 1)
        self.score = {k: v * self.decay if k[0] == layer else v for k, v in self.score.items()}
        for e, w in zip(expert_ids, weights):
            self.score[(layer, e)] = self.score.get((layer, e), 0.0) + w

    def on_access(self, key: ExpertKey) -> None:
        self.layers = max(self.layers, key[0] + 1)
        self.score[key] = self.score.get(key, 0.0) + 1.0
        self.clock += 1
        self.stamp[key] = self.clock

    def on_insert(self, key: ExpertKey) -> None:
        self.clock += 1
        self.stamp[key] = self.clock

    def victim(self, candidates: Collection[ExpertKey], current_layer: int) -> ExpertKey:
        n = self.layers = max(self.layers, current_layer + 1)
        return min(candidates, key=lambda k: (self.score.get(k, 0.0) * (n - (k[0] - current_layer) % n),
                                              self.stamp[k], k))


class LiteralNextUse(EvictionPolicy):
    """Reference: per-key dicts decayed in place; evicts max d + n * (1 / p - 1), then smallest key."""

    name = "literal-next-use"

    def __init__(self, fast: float, slow: float, w: float) -> None:
        self.fast, self.slow, self.w = fast, slow, w
        self.cf: dict[ExpertKey, float] = {}
        self.cs: dict[ExpertKey, float] = {}
        self.vf: dict[int, float] = {}
        self.vs: dict[int, float] = {}
        self.layers: set[int] = set()

    def on_route(self, layer: int, expert_ids: Sequence[int], weights: Sequence[float]) -> None:
        self.layers.add(layer)
        self.cf = {k: v * self.fast if k[0] == layer else v for k, v in self.cf.items()}
        self.cs = {k: v * self.slow if k[0] == layer else v for k, v in self.cs.items()}
        self.vf[layer] = self.vf.get(layer, 0.0) * self.fast + 1.0
        self.vs[layer] = self.vs.get(layer, 0.0) * self.slow + 1.0
        for e in set(expert_ids):
            self.cf[(layer, e)] = self.cf.get((layer, e), 0.0) + 1.0
            self.cs[(layer, e)] = self.cs.get((layer, e), 0.0) + 1.0

    def on_insert(self, key: ExpertKey) -> None:
        self.layers.add(key[0])

    def victim(self, candidates: Collection[ExpertKey], current_layer: int) -> ExpertKey:
        self.layers.add(current_layer)
        order = sorted(self.layers)
        n = len(order)

        def eta(k: ExpertKey) -> float:
            pf = self.cf.get(k, 0.0) / max(self.vf.get(k[0], 0.0), 1e-300)
            ps = self.cs.get(k, 0.0) / max(self.vs.get(k[0], 0.0), 1e-300)
            p = self.w * pf + (1.0 - self.w) * ps
            d = (order.index(k[0]) - order.index(current_layer) - 1) % n + 1
            return d + n * (1.0 / max(p, 1e-12) - 1.0)

        return min(candidates, key=lambda k: (-eta(k), k))


def random_accesses(rng: random.Random, n: int, layers: int, experts: int, width: int) -> list[tuple[int, tuple[int, ...]]]:
    return [(rng.randrange(layers), tuple(rng.sample(range(experts), rng.randint(1, width)))) for _ in range(n)]


def test_decayed_policies_match_literal_references() -> None:
    rng = random.Random(0)
    for _ in range(100):
        accesses = random_accesses(rng, 40, 3, 5, 3)
        cap = rng.randint(3, 8)
        # decay 0.5: both bookkeepings are exact in binary floating point, ties included
        assert evictions(LFUPolicy(0.5, 3), accesses, cap) == evictions(LiteralLFU(0.5, 3), accesses, cap)
        assert evictions(ActivationAwarePolicy(0.5), accesses, cap) == evictions(LiteralActivation(0.5), accesses, cap)
        assert evictions(NextUsePolicy(), accesses, cap) == evictions(LiteralNextUse(0.5, 0.99, 0.3), accesses, cap)


def optimal_misses(accesses: list[tuple[int, tuple[int, ...]]], capacity: int) -> int:
    """Exhaustive search over every eviction choice (keys of the current access protected)."""
    flat = [(frozenset((layer, e) for e in experts), (layer, e)) for layer, experts in accesses for e in experts]

    @cache
    def best(i: int, resident: frozenset[ExpertKey]) -> int:
        if i == len(flat):
            return 0
        protected, key = flat[i]
        if key in resident:
            return best(i + 1, resident)
        if len(resident) < capacity:
            return 1 + best(i + 1, resident | {key})
        return 1 + min(best(i + 1, (resident - {v}) | {key}) for v in resident - protected)

    return best(0, frozenset())


def test_belady_is_optimal() -> None:
    rng = random.Random(1)
    for _ in range(150):
        accesses = random_accesses(rng, rng.randint(5, 8), 3, 4, 2)  # ~12 key accesses
        trace = RoutingTrace.from_accesses(accesses)
        opt = optimal_misses(accesses, 3)
        assert simulate(trace, BeladyPolicy(future_of(trace)), 3).misses == opt
        for name in POLICY_NAMES:
            assert simulate(trace, make_policy(name), 3).misses >= opt


def test_next_use_with_passes_gives_the_last_visits_experts_the_measured_reselection_rate() -> None:
    """Looped MoE (passes=2): the experts of a layer's last visit get the measured rate at which
    a visit re-selects the visit before's experts, counted apart for the next pass of the same
    token and for the next token (prior 1 in 2)."""
    p = NextUsePolicy(passes=2)
    p.on_route(0, [0, 1], [1.0, 1.0])  # token 1, pass 0
    p.on_route(0, [0, 2], [1.0, 1.0])  # token 1, pass 1: 1 of 2 again -> q_pass = (1 + 1) / (2 + 2)
    p.on_route(0, [1, 3], [1.0, 1.0])  # token 2, pass 0: 0 of 2 again -> q_token = (1 + 0) / (2 + 2)
    q = p.p_next()
    assert q[0, 1] == q[0, 3] == 0.5  # the next visit is pass 1 of token 2
    p.on_route(0, [1, 0], [1.0, 1.0])  # token 2, pass 1: 1 of 2 again -> q_pass = 3 / 6
    q = p.p_next()
    assert q[0, 1] == q[0, 0] == 0.25  # the next visit is token 3's first pass
    plain = NextUsePolicy()  # the other experts keep the popularity estimate of a policy without passes
    for ids in ([0, 1], [0, 2], [1, 3], [1, 0]):
        plain.on_route(0, ids, [1.0, 1.0])
    assert q[0, 2] == plain.p_next()[0, 2] and q[0, 3] == plain.p_next()[0, 3] and q[0, 3] > 0
