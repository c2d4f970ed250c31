"""Decode attention over the paged KV cache on CPU: one C++ call per layer for every decode
request, reading keys and values in place through the block tables
(`paged_attention_cpu.cpp`, `torch.ops.moestream_cpu.paged_decode_attention`), instead of
gathering each request's blocks into a padded copy for `scaled_dot_product_attention`.
Built with the other CPU kernels (`kernels/build.py`)."""

from __future__ import annotations

import torch

from moestream.kernels.build import load_cpu_kernels


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, starts: torch.Tensor,
                           scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scale * q K^T) V for one query token per request over its cached keys.

    q [b, Hq, D] float32 or bfloat16; k_cache [N, bs, Hk, D], v_cache [N, bs, Hk, Dv] in q's
    dtype (last dim contiguous; Hq a multiple of Hk: grouped-query attention); block_tables
    [b, W] int32; seq_lens [b] int64, the context length with the query's own token; starts
    [b] int64, the first key position each query sees (a sliding window; 0 otherwise).
    Returns [b, Hq, Dv] in q's dtype (written into `out` when given: [b, Hq, Dv] with a
    contiguous last dim); the softmax is taken in float32.

    Raises:
        RuntimeError: shapes, dtypes or layouts other than these, a context longer than its
            block table, or kernels that did not build.
    """
    if not load_cpu_kernels():
        raise RuntimeError("the CPU kernels did not build (see the warning logged); use the PyTorch path")
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    torch.ops.moestream_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, starts, scale, out)
    return out
