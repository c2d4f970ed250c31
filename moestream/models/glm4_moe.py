"""GLM-4.5 / 4.6 / 4.7 (HF `Glm4MoeForCausalLM`, transformers' modeling_glm4_moe.py): GQA
attention with q/k/v bias (`attention_bias`; o_proj never has one), optional q/k RMSNorm
(`use_qk_norm`), rotate-half RoPE on the first `partial_rotary_factor` (default 0.5) of each
head; DeepSeek-V3's sigmoid bias-corrected group router; `n_shared_experts` ungated shared
experts; dense MLPs in the first `first_k_dense_replace` layers. The checkpoint's next-n
(MTP) layer (`model.layers.{L}.*`) is not read (the loader logs it)."""

from __future__ import annotations

from typing import Any

from moestream.models.config_fields import HFConfigFields, rope_fields
from moestream.models.deepseek_v3 import noaux_router
from moestream.models.moe_decoder import MoEForCausalLM


class Glm4MoeForCausalLM(MoEForCausalLM):
    display_name = "GLM-4.5"

    @classmethod
    def config_fields(cls, f: HFConfigFields, common: dict[str, Any]) -> dict[str, Any]:
        num_layers = common["num_layers"]
        first_dense = f.integer("first_k_dense_replace", default=1, minimum=0)
        inter = f.integer("moe_intermediate_size", minimum=1)
        partial = rope_fields(f).number("partial_rotary_factor", default=None)
        return dict(
            num_experts=f.integer("n_routed_experts", minimum=1),
            moe_layers=tuple(i >= first_dense for i in range(num_layers)),
            moe_intermediate_size=inter,
            shared_expert_intermediate_size=inter * (f.integer("n_shared_experts", default=1, minimum=0) or 0),
            shared_expert_gate=False,
            norm_topk_prob=f.flag("norm_topk_prob", default=True),
            qk_norm=f.flag("use_qk_norm", default=False),
            partial_rotary_factor=partial if partial is not None else f.number("partial_rotary_factor", default=0.5),
            o_proj_bias=False,
            router=noaux_router(f, 1, 1, 1.0),
        )
