"""Attention over the paged KV cache: the backend interface and its torch (CPU) implementation.

A backend writes this step's K/V into the cache at `slot_mapping`, then attends each
request's new queries to all of its cached keys. A GPU kernel (e.g. a FlashAttention
varlen/paged call) can implement the same `forward` later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from moestream.kernels.paged_attention import paged_decode_attention


@dataclass(frozen=True)
class AttentionMetadata:
    """Flat-batch layout of one step, built by the ModelRunner.

    Attributes:
        query_start_loc: [B + 1] int64; request i owns query rows [q[i], q[i+1]).
        seq_lens: [B] int64; tokens in the KV cache for request i after this step
            (computed before + new this step).
        block_tables: [B, max_blocks] int32; physical block ids, padded with 0.
        slot_mapping: [T] int64; cache slot (block_id * block_size + offset) of each new token.
        query_start_loc_cpu, seq_lens_cpu: the same as Python lists, to avoid device syncs.
        block_size: tokens per block.
        sliding: a model with a sliding-window KV cache group next to its full-attention
            one (gpt-oss): that group's block tables and slot mapping, which the layers
            with a window read and write; None otherwise. Entries of blocks behind the
            window are -1 (`NULL_BLOCK`) and never read.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    sliding: AttentionMetadata | None = None
    # What every layer of the step derives alike (a prefill's masks), made by the first layer
    # that needs it (`TorchAttentionBackend._prefill_mask`); not part of the metadata's value.
    memo: dict = field(default_factory=dict, compare=False, repr=False)


class AttentionBackend(Protocol):
    """forward(q [T, Hq, D], k [T, Hk, D], v [T, Hk, Dv], k_cache [N, block_size, Hk, D],
    v_cache [N, block_size, Hk, Dv], meta, scale, sliding_window, latent_values, sinks)
    -> [T, Hq, Dv]. Writes k/v into the caches first.

    `latent_values` > 0 (multi-head latent attention's absorbed form): `v` is None, the
    values are the first `latent_values` dims of the keys, and v_cache is not touched.
    `sinks` [Hq] (gpt-oss's attention sinks): a learned logit per head that joins each
    query's softmax denominator and attends to nothing:
    p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i))."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        latent_values: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class TorchAttentionBackend:
    """Gather each request's K/V from its blocks, then `scaled_dot_product_attention`.

    Query j of a request with n new tokens and context length L sits at absolute position
    p = L - n + j; it attends key positions t with t <= p and, with a sliding window W,
    t > p - W (HF's `sliding_window_overlay`). Requests with one new token (decodes) run
    together in one padded SDPA call; prefill chunks run one request at a time.
    `batch_invariant`: decodes run one request at a time too, so that a request's attention
    does not depend on the other requests' context lengths (the padded width).
    `paged_kernel`: decodes run through the CPU kernel that reads the blocks in place
    (`moestream/kernels/paged_attention.py`; float32 or bf16, without sinks or a latent
    head), with no gather and no padding.
    """

    def __init__(self, batch_invariant: bool = False, paged_kernel: bool = False) -> None:
        self.batch_invariant = batch_invariant
        self.paged_kernel = paged_kernel

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        latent_values: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sliding_window is not None and meta.sliding is not None:
            meta = meta.sliding  # the sliding-window group's blocks
        num_kv_heads = k.shape[1]
        bs = meta.block_size
        for cache, new in ((k_cache, k),) if v is None else ((k_cache, k), (v_cache, v)):
            if cache.is_contiguous():
                cache.view(-1, num_kv_heads, new.shape[-1]).index_copy_(0, meta.slot_mapping, new)
            else:  # an elastic memory pool's strided view: index (block, offset)
                cache.index_put_((meta.slot_mapping // bs, meta.slot_mapping % bs), new)
        out = q.new_empty(q.shape[:-1] + (latent_values or v_cache.shape[-1],))  # [T, Hq, Dv]
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        decodes = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
        batched = set(decodes) if decodes and not self.batch_invariant else set()
        if batched:
            self._batched_decode(q, k_cache, v_cache, meta, scale, sliding_window, decodes, out, latent_values, sinks)
        for i in range(len(lens)):
            if i in batched:
                continue
            qs, qe, ctx = qsl[i], qsl[i + 1], lens[i]
            n = qe - qs
            # with a window, the keys from the first block the first query can see
            first = 0 if sliding_window is None else max(0, ctx - n - sliding_window + 1) // bs
            if n == ctx and first == 0 and not latent_values and v is not None and k.dtype == k_cache.dtype:
                # a prompt's first chunk: its keys and values are this step's, just written
                keys, vals = k[qs:qe], v[qs:qe]  # [S, Hk, D], [S, Hk, Dv]
            else:
                blocks = meta.block_tables[i, first : (ctx + bs - 1) // bs]
                keys = gather_blocks(k_cache, blocks).flatten(0, 1)[: ctx - first * bs]  # [S, Hk, D]
                # [S, Hk, Dv]; MLA: the values are the latent part of the keys
                vals = keys[..., :latent_values] if latent_values else gather_blocks(v_cache, blocks).flatten(0, 1)[
                    : ctx - first * bs]
            mask = self._prefill_mask(meta, i, n, ctx, first * bs, sliding_window, q.device)  # [n, S] bool
            if latent_values:  # one shared latent head: [n * Hq, D] @ [D, ctx], no per-head copies
                out[qs:qe] = _latent_attention(q[qs:qe], keys[:, 0], vals[:, 0], mask[:, None, :], scale)
                continue
            if sinks is not None:
                out[qs:qe] = _sink_attention(q[qs:qe][None], keys[None], vals[None], mask[None], scale, sinks)[0]
                continue
            # 4-d, with K and V repeated to the query heads: on 3-d inputs or with enable_gqa
            # torch's CPU SDPA takes its math path, 4-8x slower than its flash kernel at a
            # 128-token prefill (docs/performance.md, "AMX tiles and prefill")
            group = q.shape[1] // keys.shape[1]
            o = F.scaled_dot_product_attention(
                q[qs:qe].transpose(0, 1)[None],  # [1, Hq, n, D]
                keys.transpose(0, 1).repeat_interleave(group, 0)[None],  # [1, Hq, ctx, D]
                vals.transpose(0, 1).repeat_interleave(group, 0)[None],
                attn_mask=self._additive_mask(meta, i, mask, sliding_window, q.dtype),
                scale=scale,
            )[0]  # [Hq, n, D]
            out[qs:qe] = o.transpose(0, 1)
        return out

    @staticmethod
    def _prefill_mask(meta: AttentionMetadata, i: int, n: int, ctx: int, key_start: int, sliding_window: int | None,
                      device: torch.device) -> torch.Tensor:
        """Request i's mask [n, ctx - key_start] bool: its n queries at positions ctx - n ..
        ctx - 1 against key positions key_start .. ctx - 1 (causal, and inside the window);
        made once a step (`meta.memo`)."""
        key = ("mask", i, sliding_window)
        mask = meta.memo.get(key)
        if mask is None:
            q_pos = torch.arange(ctx - n, ctx, device=device)[:, None]  # [n, 1]
            k_pos = torch.arange(key_start, ctx, device=device)[None, :]  # [1, S]
            mask = k_pos <= q_pos  # [n, S]
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            meta.memo[key] = mask
        return mask

    @staticmethod
    def _additive_mask(meta: AttentionMetadata, i: int, mask: torch.Tensor, sliding_window: int | None,
                       dtype: torch.dtype) -> torch.Tensor:
        """`mask` as the additive mask scaled_dot_product_attention makes of a bool one (0
        where True, -inf where False, in the query's dtype), made once a step."""
        key = ("additive", i, sliding_window, dtype)
        add = meta.memo.get(key)
        if add is None:
            add = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            meta.memo[key] = add
        return add

    def _batched_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        decodes: list[int],
        out: torch.Tensor,
        latent_values: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """All one-token (decode) requests in one SDPA call: their blocks gathered and padded
        to the longest context, padding and out-of-window keys masked. Writes rows of `out`."""
        bs = meta.block_size
        dev = q.device
        if self.paged_kernel and sinks is None and not latent_values and q.dtype in (torch.float32, torch.bfloat16):
            # a decode-only step: row i is request i's query, so no per-layer gathers
            only = len(decodes) == q.shape[0] == len(meta.seq_lens_cpu)
            idx = None if only else torch.tensor(decodes, device=dev)
            lens = meta.seq_lens if only else meta.seq_lens[idx]  # [b]
            tables = meta.block_tables if only else meta.block_tables[idx]
            starts = (lens - sliding_window).clamp_(min=0) if sliding_window is not None else torch.zeros_like(lens)
            if only:
                paged_decode_attention(q, k_cache, v_cache, tables, lens, starts, scale, out=out)
            else:
                rows = meta.query_start_loc[idx]  # [b] the decode rows of the flat batch
                out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, tables, lens, starts, scale)
            return
        idx = torch.tensor(decodes, device=dev)
        rows = meta.query_start_loc[idx]  # [b] the decode rows of the flat batch
        ctx = meta.seq_lens[idx][:, None]  # [b, 1]; the query sits at position ctx - 1
        if sliding_window is None:
            width = (max(meta.seq_lens_cpu[i] for i in decodes) + bs - 1) // bs
            tables = meta.block_tables[idx, :width]  # [b, W]
            k_pos = torch.arange(width * bs, device=dev)[None, :]  # [1, W*bs]
        else:  # only the blocks inside each row's window: from the block of position ctx - window
            firsts = [max(0, meta.seq_lens_cpu[i] - sliding_window) // bs for i in decodes]
            width = max((meta.seq_lens_cpu[i] + bs - 1) // bs - f for i, f in zip(decodes, firsts))
            first = torch.tensor(firsts, device=dev)[:, None]  # [b, 1]
            cols = (first + torch.arange(width, device=dev)[None, :]).clamp_(max=meta.block_tables.shape[1] - 1)
            tables = meta.block_tables[idx].gather(1, cols)  # [b, W]
            k_pos = first * bs + torch.arange(width * bs, device=dev)[None, :]  # [b, W*bs] absolute positions
        keys = gather_blocks(k_cache, tables).flatten(1, 2)  # [b, W*bs, Hk, D]
        # [b, W*bs, Hk, Dv]
        vals = keys[..., :latent_values] if latent_values else gather_blocks(v_cache, tables).flatten(1, 2)
        mask = k_pos < ctx  # [b, W*bs]
        if sliding_window is not None:
            mask &= k_pos > ctx - 1 - sliding_window
        if latent_values:
            out[rows] = _latent_attention(q[rows], keys[:, :, 0], vals[:, :, 0], mask[:, None, :], scale, batched=True)
            return
        if sinks is not None:
            out[rows] = _sink_attention(q[rows][:, None], keys, vals, mask[:, None, :], scale, sinks)[:, 0]
            return
        o = F.scaled_dot_product_attention(
            q[rows][:, :, None, :],  # [b, Hq, 1, D]
            keys.transpose(1, 2),  # [b, Hk, W*bs, D]
            vals.transpose(1, 2),
            attn_mask=mask[:, None, None, :],  # [b, 1, 1, W*bs]
            scale=scale,
            enable_gqa=True,
        )  # [b, Hq, 1, D]
        out[rows] = o[:, :, 0, :]


def gather_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, ...] and block ids table [...] int64 -> cache[table], [..., bs, ...]: the same
    values as advanced indexing, through `index_select`, which on CPU is 2-4x faster (one
    block-row copy per id instead of the generic gather: 0.15 against 0.61 ms for 16 x 12
    bf16 blocks of [16, 4, 64])."""
    return cache.index_select(0, table.flatten()).view(*table.shape, *cache.shape[1:])


def _latent_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor, scale: float,
                      batched: bool = False) -> torch.Tensor:
    """Attention of many query heads to one shared key/value head (MLA's latent), as two
    matmuls in float32 (HF's eager attention takes its softmax in float32 too).

    Unbatched: q [n, Hq, D], keys [S, D], vals [S, Dv], mask [n, 1, S] bool -> [n, Hq, Dv].
    Batched (one query per sequence): q [b, Hq, D], keys [b, S, D], vals [b, S, Dv],
    mask [b, 1, S] -> [b, Hq, Dv]. Output in q's dtype.
    """
    qf, kf, vf = q.float(), keys.float(), vals.float()
    scores = torch.matmul(qf, kf.transpose(-1, -2)) if batched else torch.matmul(qf, kf.T)  # [n|b, Hq, S]
    scores = (scores * scale).masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vf).to(q.dtype)  # [n|b, Hq, Dv]


def _sink_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor, scale: float,
                    sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per head in every softmax (gpt-oss; transformers'
    `eager_attention_forward` of modeling_gpt_oss.py: the sink joins the logits, the softmax
    runs over both, the sink's probability is dropped), in float32.

    q [b, n, Hq, D], keys [b, S, Hk, D], vals [b, S, Hk, Dv] (Hq a multiple of Hk: head h
    reads kv head h // (Hq / Hk)), mask [b, n, S] bool (True: attend), sinks [Hq]
    -> [b, n, Hq, Dv] in q's dtype.
    """
    b, n, hq, d = q.shape
    hk = keys.shape[2]
    rep = hq // hk
    qf = q.float().view(b, n, hk, rep, d).permute(0, 2, 3, 1, 4)  # [b, Hk, rep, n, D]
    kf = keys.float().permute(0, 2, 1, 3).unsqueeze(2)  # [b, Hk, 1, S, D]: no per-query-head copies
    vf = vals.float().permute(0, 2, 1, 3).unsqueeze(2)  # [b, Hk, 1, S, Dv]
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [b, Hk, rep, n, S]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    sink = sinks.float().view(1, hk, rep, 1, 1).expand(b, hk, rep, n, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # [b, Hk, rep, n, S]
    out = torch.matmul(probs, vf)  # [b, Hk, rep, n, Dv]
    return out.permute(0, 3, 1, 2, 4).reshape(b, n, hq, -1).to(q.dtype)  # [b, n, Hq, Dv]
