"""Attention over the paged KV cache: the backend interface and its torch (CPU) implementation.

A backend writes this step's K/V into the cache at `slot_mapping`, then attends each
request's new queries to all of its cached keys. A GPU kernel (e.g. a FlashAttention
varlen/paged call) can implement the same `forward` later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


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
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int


class AttentionBackend(Protocol):
    """forward(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D], k_cache, v_cache [N, block_size, Hk, D],
    meta, scale, sliding_window) -> [T, Hq, D]. Writes k/v into the caches first."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor: ...


class TorchAttentionBackend:
    """Gather each request's K/V from its blocks, then `scaled_dot_product_attention`.

    Query j of a request with n new tokens and context length L sits at absolute position
    p = L - n + j; it attends key positions t with t <= p and, with a sliding window W,
    t > p - W (HF's `sliding_window_overlay`).
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)  # [T, Hq, D]
        bs = meta.block_size
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(len(lens)):
            qs, qe, ctx = qsl[i], qsl[i + 1], lens[i]
            n = qe - qs
            blocks = meta.block_tables[i, : (ctx + bs - 1) // bs]
            keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]  # [ctx, Hk, D]
            vals = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
            q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]  # [n, 1]
            k_pos = torch.arange(ctx, device=q.device)[None, :]  # [1, ctx]
            mask = k_pos <= q_pos  # [n, ctx]
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            o = F.scaled_dot_product_attention(
                q[qs:qe].transpose(0, 1),  # [Hq, n, D]
                keys.transpose(0, 1),  # [Hk, ctx, D]
                vals.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )  # [Hq, n, D]
            out[qs:qe] = o.transpose(0, 1)
        return out
