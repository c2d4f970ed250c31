"""The three forms of the gated delta rule agree (and Kimi Delta Attention's chunked form its recurrence): chunked (WY, chunk 64), batched recurrent and
the naive token loop, from random non-zero initial states, across chunk boundaries; and the
chunked form continues exactly from its own final state (what chunked prefill relies on)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.layers.gated_delta_rule import (
    chunk_gated_delta_rule,
    naive_gated_delta_rule,
    recurrent_gated_delta_rule,
)


def _inputs(seed: int, t: int, hk: int, ratio: int, dk: int, dv: int):
    g = torch.Generator().manual_seed(seed)
    hv = hk * ratio
    q = torch.randn(t, hk, dk, generator=g)
    k = torch.randn(t, hk, dk, generator=g)
    v = torch.randn(t, hv, dv, generator=g)
    decay = -torch.rand(t, hv, generator=g) * 3  # log-decay in (-3, 0]
    beta = torch.rand(t, hv, generator=g)
    state = torch.randn(hv, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    t=st.integers(1, 150),
    hk=st.integers(1, 3),
    ratio=st.sampled_from([1, 2]),
    dk=st.sampled_from([4, 16]),
    dv=st.sampled_from([4, 8]),
)
def test_chunked_equals_naive(seed: int, t: int, hk: int, ratio: int, dk: int, dv: int) -> None:
    q, k, v, g, beta, s0 = _inputs(seed, t, hk, ratio, dk, dv)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, s0)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    assert o.shape == (t, hk * ratio, dv) and s.shape == (hk * ratio, dk, dv)
    assert (o - o_ref).abs().max().item() < 1e-5
    assert (s - s_ref).abs().max().item() < 1e-5 * max(1.0, s_ref.abs().max().item())


def test_recurrent_batch_equals_naive_per_sequence() -> None:
    """One batched recurrent step over 5 sequences with different states = each alone."""
    seqs = [_inputs(100 + i, 1, 2, 2, 8, 8) for i in range(5)]
    q, k, v, g, beta = (torch.cat([s[j] for s in seqs]) for j in range(5))
    states = torch.stack([s[5] for s in seqs])  # [5, Hv, Dk, Dv]
    o, new = recurrent_gated_delta_rule(q, k, v, g, beta, states)
    for i, s in enumerate(seqs):
        o_ref, s_ref = naive_gated_delta_rule(*s)
        assert (o[i] - o_ref[0]).abs().max().item() < 1e-5
        assert (new[i] - s_ref).abs().max().item() < 1e-5
    assert not torch.equal(new, states)  # the step did update the states


def test_zero_initial_state_is_none() -> None:
    q, k, v, g, beta, _ = _inputs(7, 70, 2, 1, 8, 8)
    o_none, s_none = chunk_gated_delta_rule(q, k, v, g, beta, None)
    o_zero, s_zero = chunk_gated_delta_rule(q, k, v, g, beta, torch.zeros_like(s_none))
    assert torch.equal(o_none, o_zero) and torch.equal(s_none, s_zero)


def test_split_continues_from_state() -> None:
    """Prefill in two pieces (carrying the state) = one piece: what chunked prefill does."""
    q, k, v, g, beta, s0 = _inputs(9, 100, 2, 2, 16, 8)
    o_full, s_full = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    o1, s1 = chunk_gated_delta_rule(q[:37], k[:37], v[:37], g[:37], beta[:37], s0)
    o2, s2 = chunk_gated_delta_rule(q[37:], k[37:], v[37:], g[37:], beta[37:], s1)
    assert (torch.cat([o1, o2]) - o_full).abs().max().item() < 1e-5
    assert (s2 - s_full).abs().max().item() < 1e-5 * max(1.0, s_full.abs().max().item())
    # ... and differs from starting the second piece from zero (the state matters).
    o2_cold, _ = chunk_gated_delta_rule(q[37:], k[37:], v[37:], g[37:], beta[37:], None)
    assert (o2_cold - o2).abs().max().item() > 1e-3


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(2, 150), heads=st.integers(1, 3), d=st.sampled_from([4, 16]),
       chunk=st.sampled_from([16, 64]))
def test_kda_chunked_equals_its_recurrence(seed: int, t: int, heads: int, d: int, chunk: int) -> None:
    """Kimi Delta Attention (per-channel decay): the chunked form against its recurrent step
    run token by token, from a random state, across chunk boundaries."""
    from moestream.layers.kimi_delta_attention import _l2norm, chunk_kda, recurrent_kda

    gen = torch.Generator().manual_seed(seed)
    q = _l2norm(torch.randn(t, heads, d, generator=gen)) * d ** -0.5
    k = _l2norm(torch.randn(t, heads, d, generator=gen))
    v = torch.randn(t, heads, d, generator=gen)
    g = -torch.rand(t, heads, d, generator=gen) * 3  # per channel, in (-3, 0]
    beta = torch.rand(t, heads, generator=gen)
    s0 = torch.randn(heads, d, d, generator=gen)
    o, s = chunk_kda(q, k, v, g, beta, s0, chunk_size=chunk)
    ref, state = [], s0[None]
    for i in range(t):
        out, state = recurrent_kda(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], state)
        ref.append(out[0])
    assert (o - torch.stack(ref)).abs().max().item() < 1e-5
    assert (s - state[0]).abs().max().item() < 1e-5 * max(1.0, state.abs().max().item())
