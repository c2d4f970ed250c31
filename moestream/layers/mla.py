"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, section 2.1) over a
paged cache of latents, in the weight-absorbed form.

HF's `DeepseekV2Attention` / `DeepseekV3Attention` expand the cached latent c [S, r] into
per-head keys k_nope = c W_UK^T and values v = c W_UV^T (`kv_b_proj`). Here the expansion
is folded into the query and the output instead (the paper's "absorb" form, as vLLM's
`MLACommonImpl` decode path): for head h,

    q_nope[h] . k_nope[h, s] = (q_nope[h] W_UK[h]) . c[s]        (W_UK[h]: [dn, r])
    sum_s p[s] v[h, s]        = (sum_s p[s] c[s]) W_UV[h]^T      (W_UV[h]: [dv, r])

so attention runs as multi-query attention with one shared key head [c | k_pe] of
r + dr dims, values = its first r dims, and the cache holds only that head: r + dr values
per token and layer (576 on DeepSeek-V2/V3 against 2 x 128 heads x 192 expanded). Prefill
uses the same form, so one path serves both.
"""

from __future__ import annotations

import torch
from torch import nn

from moestream.config import MLAConfig
from moestream.layers.attention_backend import AttentionBackend, AttentionMetadata
from moestream.layers.linear import Linear, cpu_has_native_bf16
from moestream.layers.norm import RMSNorm
from moestream.layers.rotary import RotaryEmbedding

# HF builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """forward(positions [T] int64, x [T, hidden], kv_cache (latent cache [N, block, 1, r + dr],
    unused [N, block, 1, 0]), meta) -> [T, hidden].

    Parameters as HF's: `q_proj` (q_lora_rank None) or `q_a_proj`, `q_a_layernorm`,
    `q_b_proj`; `kv_a_proj_with_mqa` [r + dr, hidden]; `kv_a_layernorm` [r]; `kv_b_proj`
    [H * (dn + dv), r]; `o_proj` [hidden, H * dv]. `rotary` None: no positional encoding
    (Kimi-Linear), the dr "rope" dims are used as projected.
    """

    def __init__(self, hidden_size: int, num_heads: int, mla: MLAConfig, bias: bool,
                 rotary: RotaryEmbedding | None, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.mla = num_heads, mla
        qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden_size, num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden_size, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank, num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.kv_b_proj.packable = False  # its weight is read directly (the absorbed products)
        self.o_proj = Linear(num_heads * mla.v_head_dim, hidden_size, bias=bias)
        self.rotary, self.backend = rotary, backend
        self._absorbed: tuple[tuple[int, int, torch.dtype], torch.Tensor, torch.Tensor] | None = None

    def absorbed_weights(self, calc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight [H * (dn + dv), r] split into the absorbed products' operands in
        `calc`: w_uk [H, dn, r] and w_uv [H, dv, r], kept per weight version and dtype, in the
        layouts torch's batched matmul reads without a copy. As strided views of the weight, the
        bf16 matmul copied both on every call (w_uk contiguous, w_uv as [H, r, dv]: 28 copies of
        2 MiB per step of a 14-layer DeepSeek-V2-Lite shape), so in bf16 / fp16 they are kept in
        those layouts (kv_b_proj's bytes again): the same operands, so the same bits. Float32
        reads strided views as they are; an upcast weight is made once instead of per step."""
        w = self.kv_b_proj.weight
        key = (w.data_ptr(), w._version, calc)
        if self._absorbed is None or self._absorbed[0] != key:
            m = self.mla
            wv = w.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank).to(calc)
            w_uk, w_uv = wv[:, : m.qk_nope_head_dim], wv[:, m.qk_nope_head_dim :]  # [H, dn, r], [H, dv, r]
            if calc != torch.float32:
                w_uk, w_uv = w_uk.contiguous(), w_uv.transpose(1, 2).contiguous().transpose(1, 2)
            self._absorbed = (key, w_uk, w_uv)
        return self._absorbed[1], self._absorbed[2]

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        m, t, h = self.mla, x.shape[0], self.num_heads
        dn, dr, r, dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, h, dn + dr).split([dn, dr], dim=-1)  # [T, H, dn], [T, H, dr]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([r, dr], dim=-1)  # [T, r], [T, dr]
        latent = self.kv_a_layernorm(latent)
        if self.rotary is not None:  # Kimi-Linear's MLA has none: its "rope" dims stay as projected
            q_pe, k_pe = self.rotary(positions, q_pe, k_pe[:, None, :])  # [T, H, dr], [T, 1, dr]
        else:
            k_pe = k_pe[:, None, :]
        # On CPUs without native bf16 matmul the absorbed products run in float32 (bf16 values
        # are exact there), whatever the batch, so a row never depends on the others.
        calc = torch.float32 if _slow_low_precision(self.kv_b_proj.weight) else self.kv_b_proj.weight.dtype
        w_uk, w_uv = self.absorbed_weights(calc)  # [H, dn, r], [H, dv, r]
        q_latent = torch.einsum("thd,hdr->thr", q_nope.to(calc), w_uk).to(x.dtype)  # [T, H, r]
        query = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, r + dr]
        key = torch.cat((latent[:, None, :], k_pe), dim=-1)  # [T, 1, r + dr], what the cache keeps
        o = self.backend.forward(query, key, None, kv_cache[0], kv_cache[1], meta, m.softmax_scale, None,
                                 latent_values=r)  # [T, H, r]
        o = torch.einsum("thr,hvr->thv", o.to(calc), w_uv).to(x.dtype)  # [T, H, dv]
        return self.o_proj(o.reshape(t, h * dv))


def _slow_low_precision(w: torch.Tensor) -> bool:
    """A bf16/fp16 weight on a CPU without native bf16 matmul (where torch's low-precision
    GEMM is several times slower than float32)."""
    return w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float16) and not cpu_has_native_bf16()
