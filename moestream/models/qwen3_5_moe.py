"""Qwen3.5-MoE, text only (HF `Qwen3_5MoeForCausalLM`, model_type `qwen3_5_moe_text`; or the
decoder of the multimodal `Qwen3_5MoeForConditionalGeneration`, model_type `qwen3_5_moe`,
under `model.language_model.`, its vision tower not loaded). Same graph as Qwen3-Next with
split GDN projections (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) and a sparse
MoE in every layer. Text positions are equal on M-RoPE's three axes, which makes M-RoPE
plain (partial) RoPE."""

from moestream.models.moe_decoder import MoEForCausalLM


class Qwen3_5MoeForCausalLM(MoEForCausalLM):
    fused_gdn_projections = False
    expert_names = (
        "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
        "model.layers.{l}.mlp.experts.{e}.up_proj.weight",
        "model.layers.{l}.mlp.experts.{e}.down_proj.weight",
    )
