"""StatePool: device slots with LRU swap to host, bit-exact round trips, reset on reuse,
committed snapshots, no leaks."""

from __future__ import annotations

import pytest
import torch

from moestream.engine.state_pool import StatePool


def _pool(max_resident: int = 2, layers: int = 2) -> StatePool:
    return StatePool(layers, (6, 3), (2, 4, 5), torch.float32, torch.float32, max_resident, torch.device("cpu"))


def _fill(pool: StatePool, slot: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for conv, ssm in pool.caches():
        conv[slot] = torch.randn(conv[slot].shape, generator=g)
        ssm[slot] = torch.randn(ssm[slot].shape, generator=g)
        out += [conv[slot].clone(), ssm[slot].clone()]
    return out


def _read(pool: StatePool, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for pair in pool.caches() for t in pair]


def test_swap_out_and_in_is_bit_exact() -> None:
    pool = _pool(max_resident=2)
    a, b = pool.prepare(["a", "b"], [True, True])
    state_a, state_b = _fill(pool, a, 1), _fill(pool, b, 2)
    (c,) = pool.prepare(["c"], [True])  # evicts the least recently used: a
    assert c == a and not pool.is_resident("a") and pool.has_state("a") and pool.num_swapped() == 1
    assert all(t.abs().sum() == 0 for t in _read(pool, c))  # c starts from zeros, not from a's state
    (a2,) = pool.prepare(["a"], [False])  # evicts b (c was used more recently)
    assert not pool.is_resident("b")
    assert all(torch.equal(x, y) for x, y in zip(_read(pool, a2), state_a))
    (b2,) = pool.prepare(["b"], [False])
    assert all(torch.equal(x, y) for x, y in zip(_read(pool, b2), state_b))
    assert pool.num_swap_outs == 3 and pool.num_swap_ins == 2


def test_reset_overwrites_a_reused_or_stale_state() -> None:
    pool = _pool(max_resident=1)
    (s,) = pool.prepare(["a"], [True])
    _fill(pool, s, 3)
    pool.free("a")
    assert pool.num_free_slots == 1 and not pool.has_state("a")
    (s2,) = pool.prepare(["b"], [True])
    assert s2 == s and all(t.abs().sum() == 0 for t in _read(pool, s2))
    _fill(pool, s2, 4)
    (s3,) = pool.prepare(["b"], [True])  # recomputed from token 0 (preempted): zeroed
    assert all(t.abs().sum() == 0 for t in _read(pool, s3))


def test_commit_and_rollback() -> None:
    pool = _pool()
    (s,) = pool.prepare(["a"], [True])
    committed = _fill(pool, s, 5)
    pool.commit("a")
    _fill(pool, s, 6)
    assert not all(torch.equal(x, y) for x, y in zip(_read(pool, s), committed))
    pool.prepare(["b", "c"], [True, True])  # a's current and committed copies go to host
    (s,) = pool.prepare(["a"], [False])
    pool.rollback("a")
    assert all(torch.equal(x, y) for x, y in zip(_read(pool, s), committed))


def test_bad_calls_are_refused_without_side_effects() -> None:
    pool = _pool(max_resident=2)
    with pytest.raises(ValueError, match="only 2 state slots"):
        pool.prepare(["a", "b", "c"], [True] * 3)
    with pytest.raises(ValueError, match="twice"):
        pool.prepare(["a", "a"], [True, True])
    assert pool.num_free_slots == 2 and pool.num_resident() == 0
    with pytest.raises(ValueError, match="at least 1"):
        _pool(max_resident=0)


def test_sizes() -> None:
    pool = StatePool(3, (6, 3), (2, 4, 5), torch.bfloat16, torch.float32, 4, torch.device("cpu"))
    per = 2 * 3 * (6 * 3 * 2 + 2 * 4 * 5 * 4)
    assert pool.bytes_per_request == per and pool.device_bytes == 4 * per
    assert pool.ssm[0].dtype == torch.float32 and pool.conv[0].dtype == torch.bfloat16
    assert pool.ssm[0].shape == (8, 2, 4, 5)
