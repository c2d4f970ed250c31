"""Mixtral (HF `MixtralForCausalLM`, transformers' modeling_mixtral.py): GQA attention
without q/k norm, `sliding_window` honoured, always-renormalised softmax top-k, every layer
sparse, experts under `block_sparse_moe` as w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from typing import Any

from moestream.models.config_fields import HFConfigFields
from moestream.models.moe_decoder import MoEForCausalLM


class MixtralForCausalLM(MoEForCausalLM):
    display_name = "Mixtral"
    expert_names = (
        "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
        "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
        "model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight",
    )

    @classmethod
    def config_fields(cls, f: HFConfigFields, common: dict[str, Any]) -> dict[str, Any]:
        return dict(
            num_experts=f.integer("num_local_experts", minimum=1),
            moe_layers=(True,) * common["num_layers"],
            moe_intermediate_size=f.integer("intermediate_size", minimum=1),
            norm_topk_prob=True,
            qk_norm=False,
            sliding_window=f.integer("sliding_window", default=None, minimum=0) or None,
        )

    def hf_name(self, name: str) -> str:
        return name.replace(".mlp.", ".block_sparse_moe.")
