"""TorchAttentionBackend against a plain softmax reference: a mixed batch (several decodes,
which run batched, and prefill chunks, which run per request), GQA, with and without a
sliding window; and the K/V it writes land in the right cache slots."""

from __future__ import annotations

import pytest
import torch

from moestream.layers.attention_backend import AttentionMetadata, TorchAttentionBackend, gather_blocks


def _reference(q, keys, vals, positions, ctx, scale, window):
    """q [n, Hq, D] at absolute `positions`, keys/vals [ctx, Hk, D] -> [n, Hq, D]."""
    rep = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(rep, dim=1)  # [ctx, Hq, D]
    v = vals.repeat_interleave(rep, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q, k) * scale  # [Hq, n, ctx]
    t = torch.arange(ctx)[None, :]
    p = torch.tensor(positions)[:, None]
    allowed = (t <= p) & ((t > p - window) if window is not None else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_batch_matches_reference(window: int | None) -> None:
    torch.manual_seed(0)
    hq, hk, d, bs, num_blocks = 4, 2, 8, 4, 40
    # (tokens already cached, new tokens): four decodes of different lengths, two prefill chunks
    reqs = [(9, 1), (0, 6), (2, 1), (13, 1), (5, 3), (0, 1)]
    k_cache = torch.randn(num_blocks, bs, hk, d)
    v_cache = torch.randn(num_blocks, bs, hk, d)
    free = list(torch.randperm(num_blocks).tolist())
    tables = [[free.pop() for _ in range((c + n + bs - 1) // bs)] for c, n in reqs]
    qsl, slots = [0], []
    for (c, n), table in zip(reqs, tables):
        qsl.append(qsl[-1] + n)
        slots += [table[p // bs] * bs + p % bs for p in range(c, c + n)]
    t = qsl[-1]
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hk, d), torch.randn(t, hk, d)
    width = max(len(x) for x in tables)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl), seq_lens=torch.tensor([c + n for c, n in reqs]),
        block_tables=torch.tensor([x + [0] * (width - len(x)) for x in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots), query_start_loc_cpu=qsl, seq_lens_cpu=[c + n for c, n in reqs], block_size=bs,
    )
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, d**-0.5, window)
    flat_k = k_cache.view(-1, hk, d)
    assert torch.equal(flat_k[torch.tensor(slots)], k)  # new keys written at their slots
    for i, ((c, n), table) in enumerate(zip(reqs, tables)):
        ctx = c + n
        keys = k_cache[torch.tensor(table)].reshape(-1, hk, d)[:ctx]
        vals = v_cache[torch.tensor(table)].reshape(-1, hk, d)[:ctx]
        ref = _reference(q[qsl[i]:qsl[i + 1]], keys, vals, list(range(c, ctx)), ctx, d**-0.5, window)
        assert (out[qsl[i]:qsl[i + 1]] - ref).abs().max().item() < 1e-5, f"request {i} ({c} cached, {n} new)"


def test_gather_blocks_equals_indexing_on_strided_caches() -> None:
    """`gather_blocks` returns cache[table] exactly, for a [b, W] table and a 1-d table, on a
    contiguous cache and on a strided view (an elastic memory pool's per-layer cache)."""
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(2, 12, 4, 2, 8, generator=g)  # [K/V, blocks, bs, Hk, D]
    table = torch.randint(0, 12, (3, 5), generator=g)
    for cache in (pool[0].clone(), pool[:, :, :, :, :].select(0, 1), pool.transpose(0, 1)[:, 0]):
        assert torch.equal(gather_blocks(cache, table), cache[table])
        assert torch.equal(gather_blocks(cache, table[1]), cache[table[1]])
    assert gather_blocks(pool[0], table).shape == (3, 5, 4, 2, 8)
