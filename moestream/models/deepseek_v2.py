"""DeepSeek-V2 / V2-Lite (HF `DeepseekV2ForCausalLM`, transformers' modeling_deepseek_v2.py):
multi-head latent attention over a latent KV cache (`MLAttention`), softmax routing with
`topk_method` "greedy" or "group_limited_greedy" and `routed_scaling_factor`,
`n_shared_experts` ungated shared experts, and dense MLPs in the first
`first_k_dense_replace` layers (and off `moe_layer_freq`, as DeepSeek's own modeling code).

As HF's router, V2 never renormalises its top-k weights, whatever `norm_topk_prob` says.
The rotary pairs are interleaved (HF's complex-number `apply_rotary_emb`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from moestream.config import MLAConfig, ModelConfig, RopeConfig, RouterConfig
from moestream.models.config_fields import HFConfigFields
from moestream.layers.attention_backend import AttentionBackend
from moestream.layers.mla import MLAttention
from moestream.layers.rotary import RotaryEmbedding
from moestream.models.moe_decoder import MoEForCausalLM


def mla_softmax_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared when the rope
    is scaled and `mscale_all_dim` is set (HF `yarn_apply_mscale` in modeling_deepseek_v2.py)."""
    scale = qk_head_dim**-0.5
    m_all = rope.get("mscale_all_dim", 0)
    if rope.rope_type != "default" and m_all:
        factor = float(rope.get("factor"))
        m = 1.0 if factor <= 1 else 0.1 * m_all * math.log(factor) + 1.0
        scale *= m * m
    return scale


def deepseek_fields(f: HFConfigFields, common: dict[str, Any], rope_interleave: bool) -> dict[str, Any]:
    """The fields DeepSeek-V2 and V3 share: MLA sizes, experts, shared experts, dense layers.

    Raises:
        ValueError: a field is missing, mistyped or out of range, or `mlp_bias` is set.
    """
    if f.flag("mlp_bias", default=False):
        raise f.error("mlp_bias", "is true; moestream's MLPs have no bias (no DeepSeek checkpoint sets it)")
    num_layers = common["num_layers"]
    num_experts = f.integer("n_routed_experts", minimum=1)
    first_dense = f.integer("first_k_dense_replace", default=0, minimum=0)
    freq = f.integer("moe_layer_freq", default=1, minimum=1)
    inter = f.integer("moe_intermediate_size", minimum=1)
    nope, rope_dim = f.integer("qk_nope_head_dim", default=128, minimum=1), f.integer("qk_rope_head_dim", default=64,
                                                                                       minimum=2)
    mla = MLAConfig(
        q_lora_rank=f.integer("q_lora_rank", default=None, minimum=1),
        kv_lora_rank=f.integer("kv_lora_rank", default=512, minimum=1),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=f.integer("v_head_dim", default=128, minimum=1),
        rope_interleave=rope_interleave,
        softmax_scale=mla_softmax_scale(nope + rope_dim, common["rope"]),
    )
    return dict(
        num_experts=num_experts,
        moe_layers=tuple(i >= first_dense and i % freq == 0 for i in range(num_layers)),
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=inter * (f.integer("n_shared_experts", default=0, minimum=0) or 0),
        shared_expert_gate=False,
        qk_norm=False,
        head_dim=rope_dim,  # as HF's config: the rotary embedding's dim
        num_kv_heads=common["num_heads"],
        mla=mla,
    )


class DeepseekV2ForCausalLM(MoEForCausalLM):
    display_name = "DeepSeek-V2"

    @classmethod
    def config_fields(cls, f: HFConfigFields, common: dict[str, Any]) -> dict[str, Any]:
        method = f.get("topk_method", str, default="greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise f.error("topk_method", f"is '{method}'; DeepSeek-V2 routes by 'greedy' or 'group_limited_greedy'")
        grouped = method == "group_limited_greedy"
        router = RouterConfig(
            scoring_func="softmax",
            topk_method=method,
            n_group=f.integer("n_group", minimum=1) if grouped else 1,
            topk_group=f.integer("topk_group", minimum=1) if grouped else 1,
            routed_scaling_factor=f.number("routed_scaling_factor", default=1.0),
            float32=True,
        )
        return dict(deepseek_fields(f, common, rope_interleave=True), router=router, norm_topk_prob=False)

    @classmethod
    def make_rotary(cls, cfg: ModelConfig, device: torch.device) -> RotaryEmbedding:
        assert cfg.mla is not None
        return RotaryEmbedding(cfg.rope, cfg.mla.qk_rope_head_dim, cfg.max_position_embeddings, device,
                               interleaved=cfg.mla.rope_interleave)

    @classmethod
    def make_attention(cls, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding,
                       backend: AttentionBackend) -> nn.Module:
        assert cfg.mla is not None
        return MLAttention(cfg.hidden_size, cfg.num_heads, cfg.mla, cfg.attention_bias, rotary, backend)
