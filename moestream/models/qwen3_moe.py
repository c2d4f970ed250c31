"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`): q/k RMSNorm, `norm_topk_prob`, dense layers from
`mlp_only_layers` / `decoder_sparse_step`."""

from moestream.models.moe_decoder import MoEForCausalLM


class Qwen3MoeForCausalLM(MoEForCausalLM):
    expert_names = (
        "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
        "model.layers.{l}.mlp.experts.{e}.up_proj.weight",
        "model.layers.{l}.mlp.experts.{e}.down_proj.weight",
    )
