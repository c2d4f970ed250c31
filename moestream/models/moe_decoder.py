"""A decoder-only MoE transformer (pre-norm; attention then MoE or dense MLP per layer).

Qwen3-MoE and Mixtral are this graph with different options and weight names; see
`qwen3_moe.py` and `mixtral.py`. Parameter names equal HF's after `hf_name`.
"""

from __future__ import annotations

import torch
from torch import nn

from moestream.config import ModelConfig
from moestream.experts.interface import ExpertStore
from moestream.layers.attention import Attention
from moestream.layers.attention_backend import AttentionBackend, AttentionMetadata
from moestream.layers.linear import Embedding, Linear
from moestream.layers.mlp import GatedMLP
from moestream.layers.moe import SparseMoE
from moestream.layers.norm import RMSNorm
from moestream.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then h + mlp(norm(h)); x [T, H] -> [T, H]."""

    def __init__(
        self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding, backend: AttentionBackend, store: ExpertStore
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
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
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module
        if cfg.moe_layers[idx]:
            self.mlp = SparseMoE(
                cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, idx, store
            )
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, store: ExpertStore, device: torch.device) -> None:
        super().__init__()
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, device)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, backend, store) for i in range(cfg.num_layers))
        moes = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
        for moe, nxt in zip(moes, moes[1:]):
            moe.lookahead = (nxt.layer_idx, nxt.gate)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoEForCausalLM(nn.Module):
    """The whole model. Subclasses set `expert_names` and may override `hf_name`.

    forward(input_ids [T] int64, positions [T] int64, kv_caches: per layer (k, v), meta)
        -> hidden states [T, H] (model dtype)
    compute_logits(hidden [N, H]) -> [N, V] float32
    """

    # Checkpoint names of expert e's (gate, up, down) weights in layer l, formatted with l and e.
    expert_names: tuple[str, str, str] = ("", "", "")

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, store: ExpertStore, device: torch.device) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act '{cfg.hidden_act}'; only silu is supported")
        self.config = cfg
        self.model = DecoderModel(cfg, backend, store, device)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def hf_name(self, name: str) -> str:
        """Checkpoint tensor name of our parameter `name`."""
        return name

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, H]
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(positions, x, kv, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
