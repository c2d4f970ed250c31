"""Qwen3.5-MoE, text only (HF `Qwen3_5MoeForCausalLM`, model_type `qwen3_5_moe_text`; or the
decoder of the multimodal `Qwen3_5MoeForConditionalGeneration`, model_type `qwen3_5_moe`,
under `model.language_model.`, its vision tower run by `moestream/multimodal/`). Same graph
as Qwen3-Next with split GDN projections (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`) and a sparse MoE in every layer, top-k always renormalised. Text positions are
equal on M-RoPE's three axes, which makes M-RoPE plain (partial) RoPE."""

from __future__ import annotations

from typing import Any

from moestream.config import MultiModalConfig
from moestream.models.config_fields import HFConfigFields, rope_fields
from moestream.models.qwen3_next import Qwen3NextForCausalLM, hybrid_fields
from moestream.validation import is_int

# Keys of the multimodal config that the decoder takes from the outer config when its text_config lacks them.
_SHARED_KEYS = ("tie_word_embeddings", "eos_token_id", "bos_token_id", "torch_dtype", "dtype")


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    display_name = "Qwen3.5-MoE"
    fused_gdn_projections = False

    @classmethod
    def decoder_fields(cls, f: HFConfigFields) -> tuple[HFConfigFields, dict[str, Any]]:
        """The multimodal class (a `text_config`): the decoder is `model.language_model.`, the
        vision tower `model.visual.`."""
        if f.hf.get("model_type") != "qwen3_5_moe" or f.hf.get("text_config") is None:
            return f, {}
        text = dict(f.get("text_config", dict))
        outer = [k for k in _SHARED_KEYS if text.get(k) is None and f.hf.get(k) is not None]
        text.update({k: f.hf[k] for k in outer})
        inner = HFConfigFields(text, f.where, f.model_name, "text_config.", {k: k for k in outer})
        extra: dict[str, Any] = {"weight_prefix": "model.language_model."}
        if f.hf.get("vision_config") is not None:
            extra["multimodal"] = _multimodal_from_hf(f, inner)
        return inner, extra

    @classmethod
    def config_fields(cls, f: HFConfigFields, common: dict[str, Any]) -> dict[str, Any]:
        return dict(
            hybrid_fields(f, common["num_layers"]),
            num_experts=f.integer("num_experts", minimum=1),
            moe_layers=(True,) * common["num_layers"],
            norm_topk_prob=True,
        )


def _multimodal_from_hf(outer: HFConfigFields, text: HFConfigFields) -> MultiModalConfig:
    """The vision fields of Qwen3.5-MoE's multimodal config (transformers'
    configuration_qwen3_5_moe.py defaults; `mrope_section` from the text config's
    `rope_parameters`, default [11, 11, 10] as HF's text rotary embedding).

    Raises:
        ValueError: a field is mistyped or out of range (see `HFConfigFields`), or `mrope_section`
            is not three non-negative integers.
    """
    vision = outer.get("vision_config", dict)
    v = HFConfigFields(vision, outer.where, outer.model_name, "vision_config.")
    section = rope_fields(text).get("mrope_section", list, default=[11, 11, 10])
    if len(section) != 3 or not all(is_int(x) and x >= 0 for x in section):
        raise text.error("rope_parameters.mrope_section", f"must be three non-negative integers; got {section}")
    return MultiModalConfig(
        image_token_id=outer.integer("image_token_id", default=248056, minimum=0),
        video_token_id=outer.integer("video_token_id", default=248057, minimum=0),
        vision_start_token_id=outer.integer("vision_start_token_id", default=248053, minimum=0),
        vision_end_token_id=outer.integer("vision_end_token_id", default=248054, minimum=0),
        spatial_merge_size=v.integer("spatial_merge_size", default=2, minimum=1),
        patch_size=v.integer("patch_size", default=16, minimum=1),
        temporal_patch_size=v.integer("temporal_patch_size", default=2, minimum=1),
        mrope_section=tuple(int(x) for x in section),  # type: ignore[arg-type]
        vision_config=dict(vision),
    )
