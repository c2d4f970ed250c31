"""Granite-4.0-H (HF `GraniteMoeHybridForCausalLM`, transformers' modeling_granitemoehybrid.py).

- `layer_types`: each layer's mixer is Mamba-2 ("mamba", or transformers 5's
  "linear_attention") or GQA attention ("attention" / "full_attention"), over a pre-norm
  residual scaled by `residual_multiplier`.
- Attention: softmax scale `attention_multiplier`; RoPE only when `position_embedding_type`
  is "rope" (Granite-4.0-H ships without positional encoding).
- Every layer: a top-k MoE (`block_sparse_moe`: the router's top-k logits softmaxed, i.e. the
  full softmax's top-k renormalized; experts stored fused, `input_linear` [E, 2I, H] with
  gate rows then up rows and `output_linear` [E, H, I]) plus an always-on shared SwiGLU MLP
  (`shared_mlp`, fused `input_linear` [2I', H]), summed.
- The input embeddings are multiplied by `embedding_multiplier`, the logits divided by
  `logits_scaling`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moestream.config import Mamba2Config, ModelConfig
from moestream.experts.interface import ExpertStore
from moestream.layers.attention import Attention
from moestream.layers.attention_backend import AttentionBackend
from moestream.layers.linear import Linear
from moestream.layers.mamba2 import Mamba2Mixer
from moestream.layers.moe import SparseMoE
from moestream.layers.rotary import RotaryEmbedding
from moestream.models.config_fields import HFConfigFields
from moestream.models.moe_decoder import MoEForCausalLM

LAYER_TYPES = {"mamba": "linear_attention", "linear_attention": "linear_attention",
               "attention": "full_attention", "full_attention": "full_attention"}


class FusedGatedMLP(nn.Module):
    """output_linear(SiLU(a) * b), [a | b] = input_linear(x): Granite's `shared_mlp`; x [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.input_linear = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.output_linear = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(torch.nn.functional.silu(gate) * up)


class GraniteMoeHybridForCausalLM(MoEForCausalLM):
    display_name = "Granite-4.0-H"
    recurrent_mixer = Mamba2Mixer
    fused_expert_names = ("model.layers.{l}.block_sparse_moe.input_linear.weight",
                          "model.layers.{l}.block_sparse_moe.output_linear.weight")

    @classmethod
    def config_fields(cls, f: HFConfigFields, common: dict[str, Any]) -> dict[str, Any]:
        num_layers = common["num_layers"]
        raw = f.get("layer_types", list, "layers_block_type", default=None) or ["mamba"] * num_layers
        if len(raw) != num_layers or any(t not in LAYER_TYPES for t in raw):
            raise f.error("layer_types", f"must list 'mamba' or 'attention' for each of the {num_layers} layers; "
                                         f"got {raw}")
        num_experts = f.integer("num_local_experts", minimum=1)
        position = f.get("position_embedding_type", str, default=None)
        if position not in (None, "rope", "nope"):
            raise f.error("position_embedding_type", f"must be 'rope', 'nope' or null, got {position!r}")
        heads, head_dim = f.integer("mamba_n_heads", minimum=1), f.integer("mamba_d_head", minimum=1)
        groups = f.integer("mamba_n_groups", default=1, minimum=1)
        if heads % groups:
            raise f.error("mamba_n_groups", f"is {groups}; it must divide the {heads} mamba_n_heads")
        expand = f.number("mamba_expand", default=2)
        if int(expand * common["hidden_size"]) != heads * head_dim:
            raise f.error("mamba_d_head", f"is {head_dim}: mamba_n_heads x mamba_d_head ({heads * head_dim}) must "
                                          f"equal mamba_expand x hidden_size ({int(expand * common['hidden_size'])})")
        limit = f.get("time_step_limit", (list, tuple), default=None)
        try:  # transformers writes infinity as {"__float__": "Infinity"}
            limit = tuple(float(v["__float__"] if isinstance(v, dict) else v) for v in limit) if limit else None
        except (KeyError, TypeError, ValueError):
            raise f.error("time_step_limit", f"must be two numbers (min, max), got {limit!r}") from None
        if limit is not None and (len(limit) != 2 or not 0 <= limit[0] <= limit[1]):
            raise f.error("time_step_limit", f"must be two numbers 0 <= min <= max, got {list(limit)}")
        return dict(
            layer_types=tuple(LAYER_TYPES[t] for t in raw),
            num_experts=num_experts,
            moe_layers=(True,) * num_layers,
            moe_intermediate_size=f.integer("intermediate_size", minimum=1),
            intermediate_size=0,
            norm_topk_prob=True,  # softmax over the top-k logits
            qk_norm=False,
            shared_expert_intermediate_size=f.integer("shared_intermediate_size", minimum=0),
            shared_expert_gate=False,
            mamba=Mamba2Config(
                num_heads=heads, head_dim=head_dim, state_size=f.integer("mamba_d_state", minimum=1), num_groups=groups,
                conv_kernel=f.integer("mamba_d_conv", default=4, minimum=2),
                conv_bias=f.flag("mamba_conv_bias", default=True), proj_bias=f.flag("mamba_proj_bias", default=False),
                chunk_size=f.integer("mamba_chunk_size", default=256, minimum=1),
                time_step_limit=limit or (0.0, float("inf"))),
            embedding_multiplier=f.number("embedding_multiplier", default=1.0),
            residual_multiplier=f.number("residual_multiplier", default=1.0),
            attention_multiplier=f.number("attention_multiplier", default=1.0),
            logits_scaling=f.number("logits_scaling", default=1.0),
            use_rope=position == "rope",
        )

    @classmethod
    def make_attention(cls, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding,
                       backend: AttentionBackend) -> nn.Module:
        if cfg.layer_types[idx] == "linear_attention":
            return Mamba2Mixer(cfg.hidden_size, cfg.mamba, cfg.rms_norm_eps)
        return Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias, None,
                         rotary if cfg.use_rope else None, backend, None, scale=cfg.attention_multiplier)

    @classmethod
    def make_mlp(cls, cfg: ModelConfig, idx: int, store: ExpertStore) -> nn.Module:
        moe = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, True, idx, store, 0, False,
                        cfg.router, cfg.expert_activation, cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            moe.shared_experts = FusedGatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        return moe

    def hf_name(self, name: str) -> str:
        name = (name.replace(".linear_attn.", ".mamba.").replace(".mlp.shared_experts.", ".shared_mlp.")
                .replace(".mlp.gate.weight", ".block_sparse_moe.router.layer.weight"))
        return super().hf_name(name)
