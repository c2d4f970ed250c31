"""A decoder-only MoE transformer (pre-norm; token mixer then MoE or dense MLP per layer).

Qwen3-MoE and Mixtral are this graph with different options and weight names; see
`qwen3_moe.py` and `mixtral.py`. The hybrid models (`qwen3_next.py`, `qwen3_5_moe.py`) mix
gated full-attention layers with Gated DeltaNet layers (`cfg.layer_types`). Parameter
names equal HF's after `hf_name`.
"""

from __future__ import annotations

import torch
from torch import nn

from moestream.config import ModelConfig
from moestream.experts.interface import ExpertStore
from moestream.layers.attention import Attention
from moestream.layers.attention_backend import AttentionBackend, AttentionMetadata
from moestream.layers.gated_delta_net import GatedDeltaNet, StateMetadata
from moestream.layers.linear import Embedding, Linear
from moestream.layers.mlp import GatedMLP
from moestream.layers.moe import SparseMoE
from moestream.layers.norm import RMSNorm
from moestream.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    """x + mixer(norm(x)), then h + mlp(norm(h)); x [T, H] -> [T, H]. The mixer is full
    attention (`self_attn`, over a paged KV cache) or Gated DeltaNet (`linear_attn`, over
    state slots)."""

    def __init__(
        self,
        cfg: ModelConfig,
        idx: int,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        store: ExpertStore,
        fused_gdn_projections: bool,
    ) -> None:
        super().__init__()
        offset = cfg.norm_unit_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.is_linear = bool(cfg.layer_types) and cfg.layer_types[idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size,
                cfg.linear_num_key_heads,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
                cfg.linear_conv_kernel_dim,
                cfg.rms_norm_eps,
                fused_gdn_projections,
            )
        else:
            self.self_attn = Attention(
                cfg.hidden_size,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                cfg.attention_bias,
                cfg.rms_norm_eps if cfg.qk_norm else None,
                rotary,
                backend,
                cfg.sliding_window,
                cfg.attn_output_gate,
                offset,
            )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.mlp: nn.Module
        if cfg.moe_layers[idx]:
            self.mlp = SparseMoE(
                cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, idx, store,
                cfg.shared_expert_intermediate_size,
            )
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        state_meta: StateMetadata | None,
        resident_only: bool = False,
    ) -> torch.Tensor:
        """cache: (k, v) for attention layers, (conv_state, ssm_state) for linear ones.
        `resident_only`: MoE layers use only experts on the device (a draft pass)."""
        if self.is_linear:
            assert state_meta is not None, "a linear-attention layer needs state metadata"
            x = x + self.linear_attn(self.input_layernorm(x), cache, state_meta)
        else:
            x = x + self.self_attn(positions, self.input_layernorm(x), cache, meta)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, resident_only=True) if resident_only and isinstance(self.mlp, SparseMoE)
                    else self.mlp(h))


class DecoderModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, store: ExpertStore, device: torch.device, fused_gdn: bool
    ) -> None:
        super().__init__()
        mm = cfg.multimodal
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, device, cfg.partial_rotary_factor,
                                 mm.mrope_section if mm is not None else None)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, rotary, backend, store, fused_gdn) for i in range(cfg.num_layers)
        )
        moes = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
        for moe, nxt in zip(moes, moes[1:]):
            moe.lookahead = (nxt.layer_idx, nxt.gate)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)


class MoEForCausalLM(nn.Module):
    """The whole model. Subclasses set `expert_names` and may override `hf_name`.

    forward(input_ids [T] int64, positions [T] int64 (or [3, T] M-RoPE positions), kv_caches:
            per full-attention layer (k, v), meta, state_caches: per linear-attention layer
            (conv, ssm), state_meta, resident_only: MoE layers route only to experts on the
            device, a draft pass; inputs_embeds [T, H]: the input embeddings to use instead of
            embedding input_ids, as multimodal prompts give)
        -> hidden states [T, H] (model dtype)
    compute_logits(hidden [N, H]) -> [N, V] float32
    """

    # Checkpoint names of expert e's (gate, up, down) weights in layer l, formatted with l and
    # e; the leading "model." stands for the config's `weight_prefix`.
    expert_names: tuple[str, str, str] = ("", "", "")
    # Qwen3-Next's fused, per-key-head interleaved GDN input projections.
    fused_gdn_projections: bool = False

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, store: ExpertStore, device: torch.device) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act '{cfg.hidden_act}'; only silu is supported")
        self.config = cfg
        self.model = DecoderModel(cfg, backend, store, device, self.fused_gdn_projections)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def hf_name(self, name: str) -> str:
        """Checkpoint tensor name of our parameter `name` (the decoder's "model." becomes the
        config's `weight_prefix`)."""
        prefix = self.config.weight_prefix
        if prefix != "model." and name.startswith("model."):
            return prefix + name[len("model."):]
        return name

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        state_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        state_meta: StateMetadata | None = None,
        resident_only: bool = False,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, H]
        kv_iter, state_iter = iter(kv_caches), iter(state_caches or ())
        for layer in self.model.layers:
            cache = next(state_iter) if layer.is_linear else next(kv_iter)
            x = layer(positions, x, cache, meta, state_meta, resident_only)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
