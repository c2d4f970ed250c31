"""Mixtral (HF `MixtralForCausalLM`): no q/k norm, always-renormalised top-k, `sliding_window`
honoured in attention, MoE weights under `block_sparse_moe` with w1 (gate), w3 (up), w2 (down)."""

from moestream.models.moe_decoder import MoEForCausalLM


class MixtralForCausalLM(MoEForCausalLM):
    expert_names = (
        "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
        "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
        "model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight",
    )

    def hf_name(self, name: str) -> str:
        return name.replace(".mlp.", ".block_sparse_moe.")
