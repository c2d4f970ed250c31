"""Qwen3-Next (HF `Qwen3NextForCausalLM`): gated full attention every `full_attention_interval`
layers, Gated DeltaNet elsewhere, MoE with a shared expert, zero-centred RMSNorm. Its GDN
input projections are fused (`in_proj_qkvz`, `in_proj_ba`) and interleaved per key head."""

from moestream.models.moe_decoder import MoEForCausalLM


class Qwen3NextForCausalLM(MoEForCausalLM):
    fused_gdn_projections = True
    expert_names = (
        "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
        "model.layers.{l}.mlp.experts.{e}.up_proj.weight",
        "model.layers.{l}.mlp.experts.{e}.down_proj.weight",
    )
