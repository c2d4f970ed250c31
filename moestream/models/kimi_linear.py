"""Kimi-Linear (HF `KimiLinearForCausalLM`, transformers' modeling_kimi_linear.py; Kimi
Linear, arXiv 2510.26692).

- `layer_types` (or the hub config's `linear_attn_config.kda_layers` /
  `full_attn_layers`, 1-indexed): Kimi Delta Attention (`layers/kimi_delta_attention.py`) or
  multi-head latent attention without positional encoding (`MLAttention` with no rotary;
  the softmax scale is (qk_nope + qk_rope)^-0.5).
- `mlp_layer_types` (or `first_k_dense_replace`, default 1): a dense SwiGLU MLP or an MoE of
  sigmoid-routed experts with `e_score_correction_bias` (DeepSeek-V3's noaux_tc router) and
  `n_shared_experts` shared experts.
- Config keys come under HF's names or the hub's (`num_experts`, `num_experts_per_token`,
  `moe_renormalize`, `num_expert_group`, `num_shared_experts`, `model_max_length`).
- Checkpoint names: the MoE block is `block_sparse_moe` (experts `w1` gate, `w3` up, `w2`
  down); the dense MLP is `mlp` in the hub's files and `block_sparse_moe` in files
  transformers 5 writes; both load.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moestream.config import MLAConfig, ModelConfig
from moestream.layers.attention_backend import AttentionBackend
from moestream.layers.kimi_delta_attention import KimiDeltaAttention
from moestream.layers.mla import MLAttention
from moestream.layers.rotary import RotaryEmbedding
from moestream.models.config_fields import HFConfigFields
from moestream.models.deepseek_v3 import noaux_router
from moestream.models.moe_decoder import MoEForCausalLM

# HF attribute name -> the name Kimi-Linear's config.json uses (KimiLinearConfig.attribute_map)
ALIASES = {"max_position_embeddings": "model_max_length", "norm_topk_prob": "moe_renormalize",
           "n_group": "num_expert_group", "num_local_experts": "num_experts",
           "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts"}
LAYER_TYPES = ("linear_attention", "full_attention")


class KimiLinearForCausalLM(MoEForCausalLM):
    display_name = "Kimi-Linear"
    recurrent_mixer = KimiDeltaAttention
    expert_names = ("model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
                    "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
                    "model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight")

    @classmethod
    def decoder_fields(cls, f: HFConfigFields) -> tuple[HFConfigFields, dict[str, Any]]:
        """The config under HF's attribute names; a field read from the hub's name is named so
        in errors."""
        hf, names = dict(f.hf), {}
        for ours, theirs in ALIASES.items():
            if hf.get(ours) is None:  # read (and named in errors) under the file's name
                hf.pop(ours, None)
                if theirs in hf:
                    hf[ours] = hf[theirs]
                names[ours] = theirs
        return HFConfigFields(hf, f.where, f.model_name, f.prefix, {**f.names, **names}), {}

    @classmethod
    def config_fields(cls, f: HFConfigFields, common: dict[str, Any]) -> dict[str, Any]:
        num_layers = common["num_layers"]
        lin = HFConfigFields(f.get("linear_attn_config", dict, default={}), f.where, f.model_name, "linear_attn_config.")
        types = f.get("layer_types", list, default=None)
        if types is None and "kda_layers" in lin.hf:
            kda, full = lin.get("kda_layers", list), lin.get("full_attn_layers", list)
            if sorted(kda + full) != list(range(1, num_layers + 1)):
                raise lin.error("kda_layers", f"and full_attn_layers must number the {num_layers} layers from 1 once "
                                              f"each; got {kda} and {full}")
            types = ["linear_attention" if i + 1 in kda else "full_attention" for i in range(num_layers)]
        if types is None:  # transformers' default: attention every 4th layer from layer 4
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]
        if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
            raise f.error("layer_types", f"must list 'linear_attention' or 'full_attention' for each of the "
                                         f"{num_layers} layers; got {types}")
        mlp_types = f.get("mlp_layer_types", list, default=None)
        if mlp_types is None:
            dense = f.integer("first_k_dense_replace", default=1, minimum=0)
            mlp_types = ["dense" if i < dense else "sparse" for i in range(num_layers)]
        if len(mlp_types) != num_layers or any(t not in ("dense", "sparse") for t in mlp_types):
            raise f.error("mlp_layer_types", f"must list 'dense' or 'sparse' for each of the {num_layers} layers; "
                                             f"got {mlp_types}")
        heads = f.integer("linear_num_heads", default=None, minimum=1) or lin.integer("num_heads", default=32, minimum=1)
        head_dim = (f.integer("linear_head_dim", default=None, minimum=1)
                    or lin.integer("head_dim", default=128, minimum=1))
        conv = (f.integer("linear_conv_kernel_dim", default=None, minimum=2)
                or lin.integer("short_conv_kernel_size", default=4, minimum=2))
        inter = f.integer("moe_intermediate_size", minimum=1)
        nope, rope_dim = f.integer("qk_nope_head_dim", default=128, minimum=1), f.integer("qk_rope_head_dim", default=64,
                                                                                           minimum=1)
        mla = MLAConfig(
            q_lora_rank=f.integer("q_lora_rank", default=None, minimum=1),
            kv_lora_rank=f.integer("kv_lora_rank", default=512, minimum=1),
            qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
            v_head_dim=f.integer("v_head_dim", default=128, minimum=1),
            rope_interleave=False, softmax_scale=(nope + rope_dim) ** -0.5,
        )
        return dict(
            layer_types=tuple(types),
            num_experts=f.integer("num_local_experts", minimum=1),
            moe_layers=tuple(t == "sparse" for t in mlp_types),
            moe_intermediate_size=inter,
            shared_expert_intermediate_size=inter * f.integer("n_shared_experts", default=1, minimum=0),
            shared_expert_gate=False,
            norm_topk_prob=f.flag("norm_topk_prob", default=True),
            router=noaux_router(f, 1, 1, 2.446),
            qk_norm=False,
            head_dim=rope_dim,
            num_kv_heads=common["num_heads"],
            mla=mla,
            use_rope=False,
            linear_conv_kernel_dim=conv,
            linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
            linear_num_key_heads=heads, linear_num_value_heads=heads,
        )

    @classmethod
    def make_attention(cls, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding,
                       backend: AttentionBackend) -> nn.Module:
        if cfg.layer_types[idx] == "linear_attention":
            return KimiDeltaAttention(cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                                      cfg.linear_conv_kernel_dim, cfg.rms_norm_eps)
        assert cfg.mla is not None
        return MLAttention(cfg.hidden_size, cfg.num_heads, cfg.mla, cfg.attention_bias, None, backend)

    def hf_name(self, name: str) -> str:
        return super().hf_name(name.replace(".linear_attn.", ".self_attn.").replace(".mlp.", ".block_sparse_moe."))

    def hf_names(self, name: str) -> tuple[str, ...]:
        """A dense MLP's weights are under `mlp.` in the hub's files, `block_sparse_moe.` in
        those transformers 5 writes."""
        ours = self.hf_name(name)
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if ".mlp." in name and layer is not None and not self.config.moe_layers[int(layer)]:
            return ours, super().hf_name(name.replace(".linear_attn.", ".self_attn."))
        return (ours,)
