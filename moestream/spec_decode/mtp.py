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
from moestream.engine.kv_cache import slot_of
from moestream.engine.kv_cache_coordinator import KVCacheCoordinator
from moestream.engine.model_runner import ModelRunner
from moestream.engine.request import Request
from moestream.experts.resident import ResidentExpertStore
from moestream.quantization.method import QuantMethod
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
             backend: AttentionBackend, method: QuantMethod | None = None) -> MTPLayer:
    """Build the MTP layer and read its weights (`mtp.*`) from `reader` (a CheckpointReader);
    weights a quantized checkpoint stores quantized (`method`) are dequantized, experts too.

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
        tensor = reader.get_weight(MTP_PREFIX + name, p.shape, method).to(device=device, dtype=dtype)
        module_name, _, leaf = name.rpartition(".")
        mtp.get_submodule(module_name)._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    inter, hidden, layer = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_layers
    gate_up = torch.empty(cfg.num_experts, 2 * inter, hidden, dtype=dtype, device=device)  # [E, 2I, H]
    down = torch.empty(cfg.num_experts, hidden, inter, dtype=dtype, device=device)  # [E, H, I]
    for e in range(cfg.num_experts):
        base = f"{MTP_PREFIX}layers.0.mlp.experts.{e}."
        gate_up[e, :inter] = reader.get_weight(base + "gate_proj.weight", (inter, hidden), method)
        gate_up[e, inter:] = reader.get_weight(base + "up_proj.weight", (inter, hidden), method)
        down[e] = reader.get_weight(base + "down_proj.weight", (hidden, inter), method)
    store.set_layer(layer, gate_up, down)
    mtp.eval()
    return mtp


@torch.inference_mode()
def mtp_draft(runner: ModelRunner, requests: list[Request], lengths: list[int], coordinator: KVCacheCoordinator
              ) -> list[list[int]]:
    """The MTP pass after a step's update (`spec_decode.mtp`). For each of `requests` (run
    in the last `execute`, not finished), one MTP row per position p it verified there:
    target hidden h_p with token x_{p+1}, at position p, into the MTP layer's KV. Then
    greedy drafts: lengths[i] tokens for request i, the first from its last row, each next
    one from the previous draft and the MTP output (one row per forward, KV at the next
    position: the caller allocated blocks through num_tokens + lengths[i] - 2).

    Returns: the drafts, lengths[i] token ids each.
    """
    dev, bs = runner.device, runner.block_size
    embed = runner.model.model.embed_tokens
    rows, ids, slots, tables, qsl, seq_lens, spans = [], [], [], [], [0], [], []
    last_row: dict[int, int] = {}  # request index -> its last row in the MTP batch
    for i, req in enumerate(requests):
        start, row0 = runner.last_rows[req.request_id]
        valid = range(start, req.num_computed_tokens)  # positions verified this step
        if not valid:
            continue
        table = coordinator.block_table(req.request_id)
        rows.extend(row0 + p - start for p in valid)
        ids.extend(req.token_ids[p + 1] for p in valid)
        spans.append((req, valid.start, valid.stop))
        slots.extend(slot_of(table, p, bs) for p in valid)
        tables.append(table)
        qsl.append(qsl[-1] + len(valid))
        seq_lens.append(req.num_computed_tokens)
        last_row[i] = qsl[-1] - 1
    if not rows:
        return [[] for _ in requests]
    hidden = runner.last_hidden[torch.tensor(rows, dtype=torch.int64, device=dev)]  # [n, H]
    out = runner.mtp(embed(torch.tensor(ids, dtype=torch.int64, device=dev)), hidden,
                   runner.rope_positions(spans), runner.mtp_kv,
                   runner.attention_metadata(qsl, seq_lens, tables, slots))  # [n, H]
    live = [i for i, n in enumerate(lengths) if n > 0 and i in last_row]
    drafts: list[list[int]] = [[] for _ in requests]
    last = out[[last_row[i] for i in live]]  # [m, H] each drafting request's last row
    for j in range(max((lengths[i] for i in live), default=0)):
        for i, t in zip(live, runner.model.compute_logits(last).argmax(-1).tolist()):
            drafts[i].append(t)
        keep = [n for n, i in enumerate(live) if lengths[i] > j + 1]
        live, last = [live[n] for n in keep], last[keep]
        if not live:
            break
        pos = [requests[i].num_computed_tokens + j for i in live]  # the draft's own position
        tabs = [coordinator.block_table(requests[i].request_id) for i in live]
        last = runner.mtp(embed(torch.tensor([drafts[i][-1] for i in live], dtype=torch.int64, device=dev)), last,
                        runner.rope_positions([(requests[i], p, p + 1) for i, p in zip(live, pos)]), runner.mtp_kv,
                        runner.attention_metadata(list(range(len(live) + 1)), [p + 1 for p in pos], tabs,
                                                 [slot_of(t, p, bs) for t, p in zip(tabs, pos)]))
    return drafts
