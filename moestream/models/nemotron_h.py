"""Nemotron-H MoE (Nemotron 3 Nano; HF `NemotronHForCausalLM`, transformers' modeling_nemotron_h.py).

Each of its layers (`layers_block_type`, or the older `hybrid_override_pattern` string of
M / * / E / -) is one pre-norm residual block, x + mixer(norm(x)), whose mixer is one of:

- "linear_attention" (M): the Mamba-2 mixer (`layers/mamba2.py`), dt clamped below at
  `time_step_min` (HF sets time_step_limit = (time_step_min, inf); its decode step does
  not clamp, we clamp in both, so that a prefill and its decode agree);
- "full_attention" (*): GQA attention without positional encoding or biases;
- "moe" (E): a sigmoid router with `e_score_correction_bias` (DeepSeek-V3's noaux_tc),
  ungated relu^2 experts (up [I, H], down [H, I]) and an always-on shared expert of the
  same kind, summed;
- "mlp" (-): a dense relu^2 MLP of `intermediate_size`.

So a layer has a KV cache, a recurrent state, routed experts, or none of them. Checkpoint
names start with "backbone." (embeddings, layers.{i}.norm / .mixer, norm_f).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moestream.config import ExpertActivation, Mamba2Config, ModelConfig
from moestream.experts.interface import ExpertStore
from moestream.layers.attention import Attention
from moestream.layers.attention_backend import AttentionBackend, AttentionMetadata
from moestream.layers.linear import Linear
from moestream.layers.mamba2 import Mamba2Mixer
from moestream.layers.moe import SparseMoE
from moestream.layers.norm import RMSNorm
from moestream.layers.recurrent_state import StateMetadata
from moestream.layers.rotary import RotaryEmbedding
from moestream.models.config_fields import HFConfigFields
from moestream.models.deepseek_v3 import noaux_router
from moestream.models.moe_decoder import MoEForCausalLM

BLOCK_TYPES = ("linear_attention", "full_attention", "moe", "mlp")
PATTERN = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}


class ReluSquaredMLP(nn.Module):
    """down_proj(relu(up_proj(x))^2): Nemotron-H's dense MLP and shared expert; x [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


class NemotronHBlock(nn.Module):
    """x + mixer(norm(x)); x [T, H] -> [T, H]. The mixer is Mamba-2 (state slots: `is_linear`),
    attention (a KV cache: `has_kv_cache`), a `SparseMoE` (`mlp`) or a dense MLP."""

    def __init__(self, cfg: ModelConfig, mixer: nn.Module) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = mixer
        self.is_linear = isinstance(mixer, Mamba2Mixer)
        self.has_kv_cache = isinstance(mixer, Attention)

    @property
    def mlp(self) -> nn.Module | None:
        """The routed-expert block, for the decoder's gate lookahead (None in other layers)."""
        return self.mixer if isinstance(self.mixer, SparseMoE) else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cache: Any, meta: AttentionMetadata,
                state_meta: StateMetadata | None) -> torch.Tensor:
        h = self.norm(x)
        if self.is_linear:
            assert state_meta is not None, "a Mamba-2 layer needs state metadata"
            return x + self.mixer(h, cache, state_meta)
        if self.has_kv_cache:
            return x + self.mixer(positions, h, cache, meta)
        return x + self.mixer(h)


class NemotronHForCausalLM(MoEForCausalLM):
    display_name = "Nemotron-H"
    recurrent_mixer = Mamba2Mixer
    expert_names = ("",  # ungated: no gate projection
                    "model.layers.{l}.mixer.experts.{e}.up_proj.weight",
                    "model.layers.{l}.mixer.experts.{e}.down_proj.weight")
    fused_expert_names = ("model.layers.{l}.mixer.experts.up_proj", "model.layers.{l}.mixer.experts.down_proj")

    @classmethod
    def decoder_fields(cls, f: HFConfigFields) -> tuple[HFConfigFields, dict[str, Any]]:
        """The layer count is the block list's length (`num_hidden_layers` may be absent);
        the checkpoint's decoder prefix is "backbone."."""
        types = cls._block_types(f)
        hf = {**f.hf, "num_hidden_layers": len(types)}
        return HFConfigFields(hf, f.where, f.model_name, f.prefix, f.names), {"weight_prefix": "backbone."}

    @staticmethod
    def _block_types(f: HFConfigFields) -> list[str]:
        """`layers_block_type`, or the older `hybrid_override_pattern` string, as block types."""
        raw = f.get("layers_block_type", (list, str), "hybrid_override_pattern")
        if isinstance(raw, str):
            if not raw or any(c not in PATTERN for c in raw):
                raise f.error("hybrid_override_pattern", f"must be a non-empty string of M, *, E and -; got {raw!r}")
            return [PATTERN[c] for c in raw]
        if not raw or any(t not in BLOCK_TYPES for t in raw):
            raise f.error("layers_block_type", f"must list one of {', '.join(BLOCK_TYPES)} per layer; got {raw}")
        return list(raw)

    @classmethod
    def config_fields(cls, f: HFConfigFields, common: dict[str, Any]) -> dict[str, Any]:
        types = cls._block_types(f)
        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            act = f.get(key, str, default=want)
            if act != want:
                raise f.error(key, f"is {act!r}; moestream supports Nemotron-H with {want!r} only")
        if f.get("moe_latent_size", int, default=None) is not None:
            raise f.error("moe_latent_size", "is set: latent MoE projections (Nemotron 3 Super) are not supported yet")
        heads, head_dim = f.integer("mamba_num_heads", minimum=1), f.integer("mamba_head_dim", minimum=1)
        groups = f.integer("n_groups", "mamba_n_groups", default=8, minimum=1)
        if heads % groups:
            raise f.error("n_groups", f"is {groups}; it must divide the {heads} mamba_num_heads")
        has_moe = "moe" in types
        return dict(
            layer_types=tuple(types),
            num_experts=f.integer("n_routed_experts", minimum=1) if has_moe else 0,
            moe_layers=tuple(t == "moe" for t in types),
            moe_intermediate_size=f.integer("moe_intermediate_size", minimum=1) if has_moe else 0,
            intermediate_size=f.integer("intermediate_size", minimum=1) if "mlp" in types else 0,
            norm_topk_prob=f.flag("norm_topk_prob", default=True),
            qk_norm=False,
            attention_bias=False,  # HF's q/k/v/o projections have no bias whatever the config says
            o_proj_bias=False,
            rms_norm_eps=f.number("layer_norm_epsilon", default=1e-5),
            shared_expert_intermediate_size=f.integer("moe_shared_expert_intermediate_size", minimum=1) if has_moe else 0,
            shared_expert_gate=False,
            router=noaux_router(f, 1, 1, 1.0),
            expert_activation=ExpertActivation("relu2"),
            mamba=Mamba2Config(
                num_heads=heads, head_dim=head_dim, state_size=f.integer("ssm_state_size", minimum=1),
                num_groups=groups, conv_kernel=f.integer("conv_kernel", "mamba_d_conv", default=4, minimum=2),
                conv_bias=f.flag("use_conv_bias", default=True), proj_bias=f.flag("use_bias", default=False),
                chunk_size=f.integer("chunk_size", "mamba_chunk_size", default=128, minimum=1),
                time_step_limit=(f.number("time_step_min", default=0.001), float("inf"))),
            use_rope=False,
        )

    @classmethod
    def make_layer(cls, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding, backend: AttentionBackend,
                   store: ExpertStore) -> NemotronHBlock:
        kind = cfg.layer_types[idx]
        mixer: nn.Module
        if kind == "linear_attention":
            mixer = Mamba2Mixer(cfg.hidden_size, cfg.mamba, cfg.rms_norm_eps)
        elif kind == "full_attention":
            mixer = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, False, None, None,
                              backend, None)
        elif kind == "moe":
            mixer = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, idx, store,
                              0, False, cfg.router, cfg.expert_activation, cfg.moe_intermediate_size)
            mixer.shared_experts = ReluSquaredMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        else:
            mixer = ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size)
        return NemotronHBlock(cfg, mixer)

    def hf_name(self, name: str) -> str:
        if name.startswith("model.embed_tokens."):
            name = "model.embeddings." + name[len("model.embed_tokens."):]
        elif name.startswith("model.norm."):
            name = "model.norm_f." + name[len("model.norm."):]
        return super().hf_name(name)
