"""DeepSeek-V3 / R1, Kimi-K2, Moonlight (HF `DeepseekV3ForCausalLM`, transformers'
modeling_deepseek_v3.py): DeepSeek-V2's multi-head latent attention and layer plan, with
sigmoid routing: experts are selected by score + `e_score_correction_bias` within the
`topk_group` best of `n_group` groups (a group ranked by the sum of its top-2), weighed by
the unbiased scores, renormalised when `norm_topk_prob`, times `routed_scaling_factor`
(DeepSeek-V3 report, arXiv 2412.19437, section 2.1.2). `rope_interleave` (default true)
picks DeepSeek's pairwise rotary layout. The checkpoint's MTP layer (`model.layers.{L}.*`)
is not read (the loader logs it)."""

from __future__ import annotations

from typing import Any

from moestream.config import RouterConfig
from moestream.models.config_fields import HFConfigFields
from moestream.models.deepseek_v2 import DeepseekV2ForCausalLM, deepseek_fields


def noaux_router(f: HFConfigFields, n_group: int, topk_group: int, scaling: float) -> RouterConfig:
    """The sigmoid, bias-corrected, group-limited router of DeepSeek-V3 and GLM-4.5, with the
    given defaults (HF's configs)."""
    return RouterConfig(
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=f.integer("n_group", default=n_group, minimum=1),
        topk_group=f.integer("topk_group", default=topk_group, minimum=1),
        routed_scaling_factor=f.number("routed_scaling_factor", default=scaling),
        float32=True,
    )


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    display_name = "DeepSeek-V3"

    @classmethod
    def config_fields(cls, f: HFConfigFields, common: dict[str, Any]) -> dict[str, Any]:
        return dict(
            deepseek_fields(f, common, rope_interleave=f.flag("rope_interleave", default=True)),
            router=noaux_router(f, 8, 4, 2.5),
            norm_topk_prob=f.flag("norm_topk_prob", default=True),
        )
