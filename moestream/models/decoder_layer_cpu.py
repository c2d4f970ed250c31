"""The compiled decode step on CPU: a decoder layer's decode-only step in one C++ call
(`kernels/decoder_layer_cpu.cpp`, `torch.classes.moestream_cpu.DecoderLayer`).

At a decode step of one or a few requests, a layer's kernels read a few MB of weights in tens
of microseconds, and the Python around them (about 100 operator and module calls a layer: the
router's softmax and top-k, the sort of the (token, expert) pairs, the KV cache writes, the
views and empties) cost as much again. The C++ layer makes the same calls in the same order on
the same kernels, so its output is the Python path's bit for bit; it plays the part vLLM's CPU
backend gives torch.compile, which was measured slower here (docs/performance.md).

It covers a layer of GQA attention (optional q/k RMSNorm, rotary embedding, a sliding window;
no sinks or output gate) and a softmax-routed, greedy top-k MoE block without shared experts on
a resident store, on the C++ kernels (`gemm_backend` cpu), in a step whose requests each bring
one token (`decode_rows`). Anything else keeps the Python layer: `layer_plan` says which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.experts.resident import ResidentExpertStore
from moestream.kernels.build import load_cpu_kernels
from moestream.kernels.fused_moe import ACT_CODES
from moestream.kernels.linear import has_amx
from moestream.layers.attention import Attention
from moestream.layers.attention_backend import AttentionMetadata, TorchAttentionBackend
from moestream.layers.expert_executor import FUSED_AMX_MIN_MEAN_ROWS, ResidentExpertExecutor, fused_max_mean_rows
from moestream.layers.linear import CPU_GEMM_MAX_ROWS, CPU_GEMM_WIDE, CPU_GEMM_WIDE_MAX_ROWS, Linear
from moestream.layers.moe import SparseMoE
from moestream.layers.norm import RMSNorm

# `Kind` in decoder_layer_cpu.cpp: the kernel a Linear's forward takes
VNNI, BLOCKED, GEMM, TORCH = 0, 1, 2, 3


@dataclass(frozen=True)
class LayerPlan:
    """A layer's C++ decode step: the `DecoderLayer` object (a torch ScriptObject), the most
    requests a step may have for it (past it, some kernel choice of the Python path depends on
    the row count), and the expert tensor it was made from (made again if the store's changes)."""

    layer: object
    max_rows: int
    gate_up_ptr: int
    sliding_window: int | None = None  # the layer's window (its keys from start = context - window)


def _gemm_rows(out_features: int) -> int:
    """The most rows `Linear.forward` gives moestream's CPU GEMM for a weight of this width."""
    return CPU_GEMM_WIDE_MAX_ROWS if out_features >= CPU_GEMM_WIDE else CPU_GEMM_MAX_ROWS


def _linear_kind(lin: Linear, dtype: torch.dtype) -> tuple[int, int] | None:
    """(Kind, the most rows it holds for) of the kernel `Linear.forward` takes for this module
    at decode sizes, or None where the C++ layer does not cover it."""
    w = lin.weight
    if lin.row_tile or lin.packed or w.device.type != "cpu":
        return None
    if lin.blocked_out:
        if w.dtype == torch.bfloat16 and dtype == torch.bfloat16:
            return VNNI, 1 << 30
        return (BLOCKED, 1 << 30) if w.dtype == torch.float32 == dtype else None
    if w.dtype != dtype:
        return None
    if lin.cpu_gemm and lin.bias is None and w.is_contiguous():
        # past the limit float32 takes F.linear (at::linear); bf16 takes `linear`'s buckets
        return GEMM, (1 << 30) if dtype == torch.float32 else _gemm_rows(w.shape[0])
    return (TORCH, 1 << 30) if dtype == torch.float32 else None


def _norm_ok(norm: RMSNorm | None, dtype: torch.dtype) -> bool:
    return norm is not None and norm.cpu_kernel and norm.weight.dtype == dtype


def layer_plan(layer: torch.nn.Module, dtype: torch.dtype) -> LayerPlan | None:
    """The C++ decode step of `layer` (a `DecoderLayer`) for compute dtype `dtype`, or None
    where it does not cover the layer (see the module docstring)."""
    if not load_cpu_kernels() or dtype not in (torch.float32, torch.bfloat16):
        return None
    attn, moe = getattr(layer, "self_attn", None), layer.mlp
    if type(attn) is not Attention or type(moe) is not SparseMoE or layer.is_linear:
        return None
    if attn.output_gate or attn.sinks is not None or layer.residual_multiplier != 1.0:
        return None
    backend = attn.backend
    if not isinstance(backend, TorchAttentionBackend) or not backend.paged_kernel or backend.batch_invariant:
        return None
    if attn.rotary is not None and not attn.rotary.cpu_kernel:
        return None
    if attn.q_norm is not None and not (_norm_ok(attn.q_norm, dtype) and _norm_ok(attn.k_norm, dtype)):
        return None
    if not (_norm_ok(layer.input_layernorm, dtype) and _norm_ok(layer.post_attention_layernorm, dtype)):
        return None
    ex, router = moe.experts, moe.gate
    if (type(ex) is not ResidentExpertExecutor or not ex.fused or ex.row_tile or ex.bias is not None
            or ex.act.name not in ACT_CODES or moe.modifier is not None or moe.shared_expert is not None
            or moe.shared_experts is not None):
        return None
    store = ex.store
    if not isinstance(store, ResidentExpertStore) or store.layout is not None or store.recorder is not None:
        return None
    rc = router.config
    if (rc.scoring_func != "softmax" or rc.topk_method != "greedy" or router.row_tile
            or router.e_score_correction_bias is not None):
        return None
    gate_up, down = store.layer_weights(ex.layer_idx)  # [E, 2I, H], [E, H, I]
    if gate_up.dtype != dtype or gate_up.device.type != "cpu":
        return None
    hidden = gate_up.shape[2]
    linears = [_linear_kind(lin, dtype) for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)]
    if router.vnni is not None and dtype == torch.bfloat16:
        linears.append((VNNI, 1 << 30))
        router_weight, router_amx = router.vnni, hidden % 32 == 0 and has_amx()
    elif router.weight.dtype == torch.float32 == dtype:
        linears.append((TORCH, 1 << 30))
        router_weight, router_amx = router.weight, False
    else:
        return None
    if any(k is None for k in linears):
        return None
    fused_rows = fused_max_mean_rows(dtype, hidden)
    act = ex.act
    cpp = torch.classes.moestream_cpu.DecoderLayer(
        attn.num_heads, attn.num_kv_heads, attn.head_dim, float(attn.scale),
        bool(attn.rotary is not None and attn.rotary.interleaved), moe.top_k, bool(moe.norm_topk_prob),
        not rc.float32, float(rc.routed_scaling_factor), ACT_CODES[act.name], float(act.alpha), float(act.limit),
        dtype == torch.bfloat16 and has_amx(), FUSED_AMX_MIN_MEAN_ROWS, fused_rows)
    none = torch.empty(0)
    q_norm, k_norm = attn.q_norm, attn.k_norm
    cpp.set_norms(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, float(layer.input_layernorm.eps),
                  bool(layer.input_layernorm.unit_offset),
                  none if q_norm is None else q_norm.weight, none if k_norm is None else k_norm.weight,
                  0.0 if q_norm is None else float(q_norm.eps), bool(q_norm is not None and q_norm.unit_offset))
    for i, lin in enumerate((attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)):
        kind, _ = linears[i]
        out_features = lin.blocked_out or lin.weight.shape[0]
        amx = kind == VNNI and lin.weight.shape[1] * 2 % 32 == 0 and has_amx()  # VNNI weight [n, K/2, 8, 16, 2]
        cpp.set_linear(i, lin.weight, none if lin.bias is None else lin.bias, kind, out_features,
                       _gemm_rows(out_features), amx)
    cpp.set_linear(4, router_weight, none if router.bias is None else router.bias, linears[4][0], moe.num_experts,
                   0, router_amx)
    cpp.set_experts(gate_up, down, store.hit_counter(ex.layer_idx, gate_up.device))
    return LayerPlan(cpp, min([fused_rows] + [rows for _, rows in linears]), gate_up.data_ptr(), attn.sliding_window)


def decode_rows(meta: AttentionMetadata, tokens: int) -> bool:
    """Whether a step of `tokens` rows is decode-only: every request brings one new token."""
    return tokens > 0 and len(meta.seq_lens_cpu) == tokens and meta.query_start_loc_cpu[-1] == tokens


def run_layer(plan: LayerPlan, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
              sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """One layer's decode step: x [T, H] -> [T, H] (the residual stream after the layer);
    writes the step's keys and values into `cache`. cos, sin: the rotary tables of the
    step's positions (empty without rotary embedding). A layer with a window reads the
    sliding group's blocks where the model has one (`meta.sliding`), as the backend does,
    from position max(0, context - window)."""
    window = plan.sliding_window
    if window is not None and meta.sliding is not None:
        meta = meta.sliding
    starts = meta.memo.get(("starts", window))
    if starts is None:  # [T] int64, once a step per window
        starts = (meta.seq_lens - window).clamp_(min=0) if window is not None else torch.zeros_like(meta.seq_lens)
        meta.memo[("starts", window)] = starts
    return plan.layer.forward(x, cache[0], cache[1], cos, sin, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                              starts)
