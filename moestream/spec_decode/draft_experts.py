"""`draft_experts` self-speculation (DraftExpert, arXiv 2607.24434): greedy drafts by the
model itself, with each MoE layer routed only to the experts already on the device, so that
a draft never waits for an expert load.

`resident_only_experts(model)` swaps every MoE layer's executor for a `ResidentOnlyExecutor`
for the span of a draft pass; the model's forward knows nothing of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from moestream.engine.kv_cache_coordinator import KVCacheCoordinator
from moestream.engine.model_runner import ModelRunner
from moestream.engine.request import Request
from moestream.experts.interface import ExpertStore
from moestream.layers.recurrent_state import StateMetadata
from moestream.config import ExpertActivation
from moestream.layers.expert_executor import SWIGLU, ExpertBias, ExpertExecutor, expert_swiglu
from moestream.layers.moe import SparseMoE
from moestream.layers.router import TopKRouter


class ResidentOnlyExecutor:
    """An expert executor for a draft pass: the router's top-k is taken again among the
    experts on the device now and renormalised to the mass the unrestricted top-k had. The
    unrestricted choice goes to the store as a retention hint and, where not resident, as a
    prefetch: the verify pass routes those experts again. Nothing is counted as a hit or
    miss, and the eviction policy sees no access.

    forward(x [T, H], topk_weights [T, k], topk_ids [T, k]) -> [T, H] float32; the given
    top-k is not used (the scores are recomputed from x, as the draft's routing needs every
    expert's score).
    """

    def __init__(self, store: ExpertStore, router: TopKRouter, layer_idx: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, row_tile: int, act: ExpertActivation = SWIGLU,
                 bias: ExpertBias | None = None) -> None:
        self.store, self.router, self.layer_idx = store, router, layer_idx
        self.num_experts, self.top_k, self.norm_topk_prob, self.row_tile = num_experts, top_k, norm_topk_prob, row_tile
        self.act, self.bias = act, bias

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        router = self.router
        scores = router.scores(x)  # [T, E]
        choice = router.choice_scores(scores)  # [T, E]
        full_ids = router.select(choice)  # [T, k] what the full model picks
        full_w = router.weigh(scores, full_ids)  # [T, k]
        view = self.store.resident_view(self.layer_idx)
        resident = torch.zeros(self.num_experts, dtype=torch.bool, device=x.device)
        resident[list(view)] = True
        wanted = set(full_ids.flatten().tolist())
        self.store.hint(self.layer_idx, sorted(wanted))  # the verify pass routes these again: keep them
        missing = sorted(wanted - set(view))
        if missing:
            self.store.prefetch(self.layer_idx, missing)
        masked = choice.masked_fill(~resident, float("-inf"))  # [T, E] non-resident experts rank last
        ids = torch.topk(masked, self.top_k, dim=-1)[1]  # [T, k]
        weights = scores.gather(1, ids) * resident[ids]  # [T, k]; fewer than k resident: the rest weigh 0
        if self.norm_topk_prob:  # the mass the unrestricted top-k had
            total = torch.full_like(full_w[:, :1], router.config.routed_scaling_factor)
        else:
            total = full_w.sum(-1, keepdim=True)
        weights = weights * (total / weights.sum(-1, keepdim=True).clamp_min(1e-20))  # [T, k]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        for e in torch.unique(ids).tolist():
            w = view.get(e)
            if w is None:
                continue
            rows, which = (ids == e).nonzero(as_tuple=True)  # [n] token rows, their top-k index
            y = expert_swiglu(x[rows], w, self.row_tile, self.act, None if self.bias is None else self.bias.of(e))
            out.index_add_(0, rows, y.float() * weights[rows, which, None])
        return out


@contextmanager
def resident_only_experts(model: nn.Module) -> Iterator[None]:
    """Within the block, every MoE layer of `model` computes with `ResidentOnlyExecutor`
    (a draft pass); its own executor is back on exit, also on an error."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    saved: list[ExpertExecutor] = [m.experts for m in layers]
    try:
        for m in layers:
            m.experts = ResidentOnlyExecutor(m.experts.store, m.gate, m.layer_idx, m.num_experts, m.top_k,
                                             m.norm_topk_prob, m.experts.row_tile, m.experts.act, m.experts.bias)
        yield
    finally:
        for m, executor in zip(layers, saved):
            m.experts = executor


@torch.inference_mode()
def draft_pass(runner: ModelRunner, requests: list[Request], lengths: list[int],
               coordinator: KVCacheCoordinator) -> list[list[int]]:
    """Greedy drafts with the experts already on the device (`draft_experts`): up to
    lengths[i] tokens after request i's last token, one token per forward for all the
    requests still drafting. Each forward writes KV at the positions the verify step
    computes again (it overwrites them); on a hybrid model the drafts advance a copy of
    the request's state in its last speculative row, never the state itself. The caller
    has allocated blocks for every drafted position and made the states resident.

    Returns: the drafts, lengths[i] token ids each (greedy: one point-mass proposal per
    position, verified by the target's own samples).
    """
    dev = runner.device
    pool = runner.state_pool
    rows: list[int] = []
    if pool is not None:
        for req in requests:
            slot = pool.slot_of(req.request_id)
            rows.append(pool.spec_row(slot, pool.num_spec_rows - 1))
            pool.copy_row(slot, rows[-1])
    drafts: list[list[int]] = [[] for _ in requests]
    with resident_only_experts(runner.model):  # one executor swap for the whole draft pass
        for j in range(max(lengths, default=0)):
            live = [i for i, n in enumerate(lengths) if n > j]
            ids, positions = [], []
            for i in live:
                req = requests[i]
                ids.append(drafts[i][-1] if j else req.token_ids[-1])
                positions.append(req.num_tokens - 1 + j)
            qsl = list(range(len(live) + 1))
            meta = runner.batch_metadata(coordinator, [(requests[i].request_id, p, p + 1) for i, p in zip(live, positions)])
            state_caches, state_meta = None, None
            if pool is not None:
                live_rows = [rows[i] for i in live]
                state_caches = pool.caches()
                state_meta = StateMetadata(qsl, live_rows, torch.tensor(live_rows, dtype=torch.int64, device=dev))
            rope = runner.rope_positions([(requests[i], p, p + 1) for i, p in zip(live, positions)])
            hidden = runner.model(torch.tensor(ids, dtype=torch.int64, device=dev), rope, runner.kv_caches, meta,
                                  state_caches, state_meta)  # [n, H]
            for i, t in zip(live, runner.model.compute_logits(hidden).argmax(-1).tolist()):
                drafts[i].append(t)
    return drafts
