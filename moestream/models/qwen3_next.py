"""Qwen3-Next (HF `Qwen3NextForCausalLM`, transformers' modeling_qwen3_next.py): gated full
attention every `full_attention_interval` layers, Gated DeltaNet elsewhere, MoE with a
sigmoid-gated shared expert, zero-centred RMSNorm, partial rotary. Its GDN input
projections are fused (`in_proj_qkvz`, `in_proj_ba`) and interleaved per key head."""

from __future__ import annotations

from typing import Any

from torch import nn

from moestream.config import ModelConfig
from moestream.models.config_fields import HFConfigFields, rope_fields, sparse_layers
from moestream.layers.attention_backend import AttentionBackend
from moestream.layers.gated_delta_net import GatedDeltaNet
from moestream.layers.rotary import RotaryEmbedding
from moestream.models.moe_decoder import MoEForCausalLM


def hybrid_fields(f: HFConfigFields, num_layers: int) -> dict[str, Any]:
    """The fields Qwen3-Next and Qwen3.5-MoE share (transformers' configuration_qwen3_next.py
    and configuration_qwen3_5_moe.py, including their defaults).

    Raises:
        ValueError: `layer_types` is malformed, or a field is missing or mistyped (see `HFConfigFields`).
    """
    layer_types = f.get("layer_types", list, default=None)
    if layer_types is None:
        interval = f.integer("full_attention_interval", default=4, minimum=1)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or any(t not in ("linear_attention", "full_attention") for t in layer_types):
        raise f.error(
            "layer_types",
            f"must list 'full_attention' or 'linear_attention' for each of the {num_layers} layers; got {layer_types}",
        )
    partial = rope_fields(f).number("partial_rotary_factor", default=None)
    return dict(
        layer_types=tuple(layer_types),
        linear_conv_kernel_dim=f.integer("linear_conv_kernel_dim", default=4, minimum=1),
        linear_key_head_dim=f.integer("linear_key_head_dim", default=128, minimum=1),
        linear_value_head_dim=f.integer("linear_value_head_dim", default=128, minimum=1),
        linear_num_key_heads=f.integer("linear_num_key_heads", default=16, minimum=1),
        linear_num_value_heads=f.integer("linear_num_value_heads", default=32, minimum=1),
        shared_expert_intermediate_size=f.integer("shared_expert_intermediate_size", default=0, minimum=0),
        shared_expert_gate=True,
        attn_output_gate=True,
        partial_rotary_factor=partial if partial is not None else f.number("partial_rotary_factor", default=0.25),
        norm_unit_offset=True,
        moe_intermediate_size=f.integer("moe_intermediate_size", minimum=1),
        qk_norm=True,
    )


class Qwen3NextForCausalLM(MoEForCausalLM):
    display_name = "Qwen3-Next"
    # Qwen3-Next's fused, per-key-head interleaved GDN input projections.
    fused_gdn_projections: bool = True
    recurrent_mixer = GatedDeltaNet

    @classmethod
    def config_fields(cls, f: HFConfigFields, common: dict[str, Any]) -> dict[str, Any]:
        num_experts = f.integer("num_experts", minimum=0)
        return dict(
            hybrid_fields(f, common["num_layers"]),
            num_experts=num_experts,
            moe_layers=sparse_layers(f, common["num_layers"], num_experts),
            norm_topk_prob=f.flag("norm_topk_prob", default=True),
        )

    @classmethod
    def make_attention(cls, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding,
                       backend: AttentionBackend) -> nn.Module:
        if cfg.layer_types[idx] == "full_attention":
            return super().make_attention(cfg, idx, rotary, backend)
        return GatedDeltaNet(
            cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps, cls.fused_gdn_projections,
        )
