"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`, transformers' modeling_qwen3_moe.py): GQA attention
with q/k RMSNorm, softmax top-k routing with optional `norm_topk_prob`, dense layers from
`mlp_only_layers` / `decoder_sparse_step`, optional sliding window."""

from __future__ import annotations

from typing import Any

from moestream.models.config_fields import HFConfigFields, sparse_layers
from moestream.models.moe_decoder import MoEForCausalLM


class Qwen3MoeForCausalLM(MoEForCausalLM):
    display_name = "Qwen3-MoE"

    @classmethod
    def config_fields(cls, f: HFConfigFields, common: dict[str, Any]) -> dict[str, Any]:
        num_experts = f.integer("num_experts", "num_local_experts", minimum=0)
        sliding = f.integer("sliding_window", default=None, minimum=0) if f.flag("use_sliding_window", False) else None
        return dict(
            num_experts=num_experts,
            moe_layers=sparse_layers(f, common["num_layers"], num_experts),
            moe_intermediate_size=f.integer("moe_intermediate_size", minimum=1),
            norm_topk_prob=f.flag("norm_topk_prob", default=False),
            qk_norm=True,
            sliding_window=sliding or None,
        )
