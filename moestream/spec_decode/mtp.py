"""Multi-token prediction (MTP) drafts from the checkpoint's own `mtp.*` layer (Qwen3-Next,
Qwen3.5-MoE hub checkpoints).

The MTP module (vLLM's vllm/model_executor/models/qwen3_next_mtp.py layout) takes the target
model's final hidden state h_p at position p and the embedding of token x_{p+1}:

    x = fc([pre_fc_norm_embedding(embed(x_{p+1})) | pre_fc_norm_hidden(h_p)])   # [T, 2H] -> [T, H]
    x = decoder layer (full attention over its own paged KV, sparse MoE + shared expert)
    h' = norm(x); logits = lm_head(h')   -> a draft for x_{p+2}

Its attention runs at position p (the target's positions) over its own KV cache, which
shares the requests' block tables. Every token the target computes gets its MTP row in the
same step, so the MTP cache stays complete (prefix hits included); further drafts chain
h' and the previous draft. Weights: `mtp.fc`, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` (a full-attention MoE decoder layer, experts under
`mtp.layers.0.mlp.experts.{e}`), `mtp.norm`. Its routed experts are always resident.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moestream.config import ModelConfig
from moestream.experts.resident import ResidentExpertStore
from moestream.layers.attention_backend import AttentionBackend, AttentionMetadata
from moestream.layers.linear import Linear
from moestream.layers.norm import RMSNorm
from moestream.models.registry import get_model_class

MTP_PREFIX = "mtp."


class MTPLayer(nn.Module):
    """forward(embeds [T, H], hidden [T, H], positions [T] (or [3, T] M-RoPE), kv (k, v), meta) -> [T, H] (normed)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, store: ResidentExpertStore,
                 device: torch.device) -> None:
        super().__init__()
        h, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset
        # The MTP decoder layer is one more full-attention MoE layer after the model's.
        layer_cfg = dataclasses.replace(
            cfg, num_layers=cfg.num_layers + 1, moe_layers=cfg.moe_layers + (True,),
            layer_types=(cfg.layer_types or ("full_attention",) * cfg.num_layers) + ("full_attention",))
        model_class = get_model_class(cfg.model_type)
        rotary = model_class.make_rotary(cfg, device)
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, offset)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, offset)
        self.layers = nn.ModuleList([model_class.make_layer(layer_cfg, cfg.num_layers, rotary, backend, store)])
        self.norm = RMSNorm(h, eps, offset)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1)  # [T, 2H]
        x = self.layers[0](positions, self.fc(x), kv, meta, None)  # [T, H]
        return self.norm(x)


def has_mtp(weight_names: object) -> bool:
    """True when a checkpoint's tensor names include the MTP layer (`mtp.fc.weight`)."""
    return "mtp.fc.weight" in weight_names  # type: ignore[operator]


def load_mtp(cfg: ModelConfig, reader, dtype: torch.dtype, device: torch.device,
             backend: AttentionBackend) -> MTPLayer:
    """Build the MTP layer and read its weights (`mtp.*`) from `reader` (a CheckpointReader).

    Raises:
        ValueError: the checkpoint has no `mtp.*` weights (the message says so and what to
            use instead), or one is missing or misshapen (CheckpointReader's error).
    """
    if not has_mtp(reader.weight_map):
        raise ValueError("speculative method 'mtp' needs the checkpoint's multi-token-prediction weights (mtp.*), "
                         "and this checkpoint has none; use 'ngram' or 'draft_experts' instead")
    store = ResidentExpertStore()
    with torch.device("meta"):
        mtp = MTPLayer(cfg, backend, store, device)
    for name, p in list(mtp.named_parameters()):
        tensor = reader.get(MTP_PREFIX + name, p.shape).to(device=device, dtype=dtype)
        module_name, _, leaf = name.rpartition(".")
        mtp.get_submodule(module_name)._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    inter, hidden, layer = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_layers
    gate_up = torch.empty(cfg.num_experts, 2 * inter, hidden, dtype=dtype, device=device)  # [E, 2I, H]
    down = torch.empty(cfg.num_experts, hidden, inter, dtype=dtype, device=device)  # [E, H, I]
    for e in range(cfg.num_experts):
        base = f"{MTP_PREFIX}layers.0.mlp.experts.{e}."
        gate_up[e, :inter] = reader.get(base + "gate_proj.weight", (inter, hidden))
        gate_up[e, inter:] = reader.get(base + "up_proj.weight", (inter, hidden))
        down[e] = reader.get(base + "down_proj.weight", (hidden, inter))
    store.set_layer(layer, gate_up, down)
    mtp.eval()
    return mtp
