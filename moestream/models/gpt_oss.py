"""gpt-oss (HF `GptOssForCausalLM`, transformers' modeling_gpt_oss.py).

- Attention: biased GQA q/k/v/o, no q/k norm, YaRN RoPE, a learned softmax sink per head
  (`sinks`), and `layer_types` alternating "sliding_attention" (a window of
  `sliding_window` tokens) and "full_attention".
- MoE in every layer: the router is a biased linear layer, top-k of the logits, softmax
  over those k; the experts use the clamped SwiGLU "swigluoai" (`swiglu_alpha`,
  `swiglu_limit`) with biases.
- Experts stored fused, as transformers keeps them in memory: `mlp.experts.gate_up_proj`
  [E, H, 2I] (gate and up outputs interleaved) and `mlp.experts.down_proj` [E, I, H], both
  multiplied as x @ W (so transposed against nn.Linear's [out, in]); or MXFP4
  (`*_blocks` / `*_scales`, [out, in] as nn.Linear).
"""

from __future__ import annotations

from typing import Any

from moestream.config import ExpertActivation, RouterConfig
from moestream.models.config_fields import HFConfigFields
from moestream.models.moe_decoder import MoEForCausalLM

LAYER_TYPES = ("sliding_attention", "full_attention")


class GptOssForCausalLM(MoEForCausalLM):
    display_name = "gpt-oss"
    fused_experts_transposed = True

    @classmethod
    def config_fields(cls, f: HFConfigFields, common: dict[str, Any]) -> dict[str, Any]:
        num_layers = common["num_layers"]
        layer_types = f.get("layer_types", list, default=None)
        if layer_types is None:  # transformers' GptOssConfig default: sliding, full, sliding, ...
            layer_types = [LAYER_TYPES[i % 2] for i in range(num_layers)]
        if len(layer_types) != num_layers or any(t not in LAYER_TYPES for t in layer_types):
            raise f.error("layer_types", f"must list 'sliding_attention' or 'full_attention' for each of the "
                                         f"{num_layers} layers; got {layer_types}")
        window = f.integer("sliding_window", default=None, minimum=1)
        if window is None and "sliding_attention" in layer_types:
            raise f.error("sliding_window", "is missing, but layer_types has sliding_attention layers")
        limit = f.number("swiglu_limit", default=7.0)
        if limit <= 0:
            raise f.error("swiglu_limit", f"must be positive, got {limit}")
        return dict(
            num_experts=f.integer("num_local_experts", minimum=1),
            moe_layers=(True,) * num_layers,
            moe_intermediate_size=f.integer("intermediate_size", minimum=1),
            norm_topk_prob=True,
            qk_norm=False,
            sliding_window=window,
            layer_types=tuple(layer_types),
            attention_sinks=True,
            expert_activation=ExpertActivation("swigluoai", f.number("swiglu_alpha", default=1.702), limit, bias=True),
            router=RouterConfig(bias=True),
        )

    def hf_name(self, name: str) -> str:
        return super().hf_name(name.replace(".mlp.gate.", ".mlp.router.").replace(".mlp.expert_bias.", ".mlp.experts."))
