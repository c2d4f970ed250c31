"""StatePool: device slots with LRU swap to host, bit-exact round trips, reset on reuse,
speculative rows and acceptance, no leaks."""

from __future__ import annotations

import pytest
import torch

from moestream.engine.state_pool import StatePool
from moestream.layers.recurrent_state import StateSpec


GDN = (StateSpec("conv", (6, 3), torch.float32), StateSpec("ssm", (2, 4, 5), torch.float32))
# another mixer's state (three tensors, two dtypes), as Kimi Delta Attention's q/k/v convs would be
THREE = (StateSpec("conv_q", (4, 3), torch.bfloat16), StateSpec("conv_k", (4, 3), torch.bfloat16),
         StateSpec("recurrent", (2, 4, 4), torch.float32))


def _pool(max_resident: int = 2, layers: int = 2, specs: tuple[StateSpec, ...] = GDN) -> StatePool:
    return StatePool(layers, specs, max_resident, torch.device("cpu"))


def _fill(pool: StatePool, slot: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for tensors in pool.caches():
        for t in tensors:
            t[slot] = torch.randn(t[slot].shape, generator=g).to(t.dtype)
            out.append(t[slot].clone())
    return out


def _read(pool: StatePool, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for pair in pool.caches() for t in pair]


@pytest.mark.parametrize("specs", [GDN, THREE], ids=["gdn", "three_tensors"])
def test_swap_out_and_in_is_bit_exact(specs: tuple[StateSpec, ...]) -> None:
    pool = _pool(max_resident=2, specs=specs)
    assert [len(c) for c in pool.caches()] == [len(specs)] * 2
    assert pool.bytes_per_state == 2 * sum(s.nbytes for s in specs)
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


def test_speculative_rows_and_accept() -> None:
    pool = StatePool(2, GDN, 2, torch.device("cpu"), num_checkpoint_rows=1,
                     num_spec_rows=3)
    assert pool.tensors["conv"][0].shape[0] == 2 + 2 * 3 + 1 and pool.checkpoint_row(0) == 8
    assert [pool.spec_row(1, j) for j in range(3)] == [5, 6, 7]
    with pytest.raises(IndexError, match="no speculative row 3 of slot 0"):
        pool.spec_row(0, 3)
    pool.prepare(["x"], [True])
    (s,) = pool.prepare(["a"], [True])
    rows = [_fill(pool, pool.spec_row(s, j), 10 + j) for j in range(3)]  # after positions 1, 2, 3
    last = _fill(pool, s, 20)  # after position 4
    pool.accept("a", 4, 4)  # all accepted: the slot keeps its state
    assert all(torch.equal(x, y) for x, y in zip(_read(pool, s), last))
    pool.accept("a", 2, 4)  # positions 1-2 accepted: the state after position 2
    assert all(torch.equal(x, y) for x, y in zip(_read(pool, s), rows[1]))
    with pytest.raises(ValueError, match="outside"):
        pool.accept("a", 0, 4)
    # The speculative rows are scratch: a swap moves the slot's state only, bit for bit.
    pool.prepare(["b", "c"], [True, True])
    (s2,) = pool.prepare(["a"], [False])
    assert all(torch.equal(x, y) for x, y in zip(_read(pool, s2), rows[1]))


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
    mixed = (StateSpec("conv", (6, 3), torch.bfloat16), StateSpec("ssm", (2, 4, 5), torch.float32))
    pool = StatePool(3, mixed, 4, torch.device("cpu"))
    per = 3 * (6 * 3 * 2 + 2 * 4 * 5 * 4)
    assert pool.bytes_per_state == per and pool.bytes_per_request == per and pool.device_bytes == 4 * per
    assert pool.tensors["ssm"][0].dtype == torch.float32 and pool.tensors["conv"][0].dtype == torch.bfloat16
    assert pool.tensors["ssm"][0].shape == (4, 2, 4, 5)
    spec = StatePool(3, mixed, 4, torch.device("cpu"), num_spec_rows=2)
    assert spec.bytes_per_request == 3 * per and spec.tensors["ssm"][0].shape == (12, 2, 4, 5)
