"""GQA self-attention with optional q/k RMSNorm (Qwen3) and attention sinks (gpt-oss) over a paged KV cache.

Follows transformers' Qwen3MoeAttention / MixtralAttention, and Qwen3NextAttention's
gated form (`output_gate`: q_proj gives [query | gate] per head and the output is
multiplied by sigmoid(gate) before o_proj). The KV cache and the attention math live in
the backend (`attention_backend.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from moestream.layers.attention_backend import AttentionBackend, AttentionMetadata
from moestream.layers.linear import Linear
from moestream.layers.norm import RMSNorm
from moestream.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """forward(positions [T] int64, x [T, hidden], kv_cache (k, v) each [N, block, Hk, D], meta) -> [T, hidden].

    `bias` applies to q/k/v_proj, and to o_proj unless `o_bias` says otherwise (GLM-4.5:
    q/k/v biased, o_proj never). `sinks`: a learned per-head softmax sink `sinks` [Hq]
    (gpt-oss, transformers' GptOssAttention); `sliding_window`: this layer's window or None;
    `rotary` None: no positional encoding (Granite-4.0-H); `scale`: the softmax scale
    (default head_dim ** -0.5; Granite: its attention_multiplier)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        qk_norm_eps: float | None,
        rotary: RotaryEmbedding | None,
        backend: AttentionBackend,
        sliding_window: int | None,
        output_gate: bool = False,
        norm_unit_offset: bool = False,
        o_bias: bool | None = None,
        sinks: bool = False,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        self.q_proj = Linear(hidden_size, num_heads * head_dim * (2 if output_gate else 1), bias=bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias if o_bias is None else o_bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, norm_unit_offset)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.backend = backend
        self.sliding_window = sliding_window
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if sinks else None
        self.scale = head_dim**-0.5 if scale is None else scale

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        gate = None
        if self.output_gate:
            q, gate = self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [T, Hq, D] each
        else:
            q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window,
                                 sinks=self.sinks)
        o = o.reshape(t, self.num_heads * self.head_dim)  # [T, Hq * D]
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(o)
