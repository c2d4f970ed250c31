"""Expert executors: what computes a MoE layer's routed experts once the router has chosen.

`SparseMoE` routes; an executor computes. In the style of mini-sglang's MoE backend
(`minisgl/layers/moe.py` handing off to `minisgl/moe/`), the layer does not know whether its
experts are resident or paged:

- `ResidentExpertExecutor`: every expert of the layer stacked on the device ([E, 2I, H] and
  [E, H, I]). The (token, k) pairs are sorted by expert once, both projections run as one
  grouped matmul each over all active experts (`torch._grouped_mm`, offsets computed on the
  device), and the outputs are combined with a weighted `index_add_` (`weighted_sum`). No
  Python work per expert and no host sync on this path (the routing recorder, when on, is the
  exception; so is bf16 on a CPU with native bf16, where each group is padded to
  `bucket_rows` of its count, as `linear` pads a call, and the padded total is read on the
  host, which there is the device). With fewer (token, k) pairs than half the experts it
  loops over the active ones instead.
- `PagedExpertExecutor`: the expert store's contract (`ExpertStore`): the router's choice
  goes to `on_route`, the active experts are made resident with `ensure` in waves of at most
  the store's slots, and the next layer's experts are predicted for prefetch (gate
  lookahead) after the first wave is ensured.

Both compute an expert the same way, so that the output is bit-identical whatever the
budget (DESIGN.md's invariant): on CPU `torch._grouped_mm` runs each group as the same
`mm` as `F.linear` on that group's rows (tests/test_expert_executor.py holds this), and
where that is not so (bf16 on CPUs without native bf16, where `linear` upcasts calls of 8+
rows; CUDA, where the grouped kernel is its own; the batch-invariant mode) the resident
executor runs the per-expert loop the paged one runs.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from moestream.config import ExpertActivation
from moestream.experts.interface import ExpertStore, ExpertWeights, PackedExpert
from moestream.experts.resident import ResidentExpertStore
from moestream.kernels.fused_moe import ACT_CODES, fused_moe, fused_moe_int
from moestream.kernels.linear import has_amx
from moestream.layers.activation import gated_activation
from moestream.layers.linear import ONEDNN_ROW_BUCKET, buckets_rows, linear, upcasts
from moestream.quantization.method import IntWeights
from moestream.quantization.packed import dequantize_expert, int_expert


SWIGLU = ExpertActivation()

# Rows per chunk of `weighted_sum` (1024 x H float32: 2 MiB at H = 512).
COMBINE_CHUNK = 1024

# The fused CPU kernel runs a layer when its active experts have at most this many rows
# (token, expert pairs) on average (compute dtype -> rows); above it the PyTorch path's
# matmuls (MKL; oneDNN, with AMX where the CPU has it, in bf16) are faster (docs/performance.md,
# "AMX tiles and prefill": float32 1.16x at 128 rows; bf16 without AMX tiles 1.18x at 16, 0.81x
# at 32). One rule for the whole layer, so the resident and paged executors, seeing the same
# counts, always take the same path.
FUSED_MAX_MEAN_ROWS = {torch.float32: 128, torch.bfloat16: 12}
# bf16 where the kernel takes AMX tiles (hidden size a multiple of 32): 1.1-1.7x oneDNN up to
# 256 rows per expert, the most a default 2048-token step gives 64 experts top-8.
FUSED_MAX_MEAN_ROWS_AMX = 256
# ... and takes AMX tiles only past this many rows per active expert on average: at fewer, the
# weights stream from memory faster through the AVX512_BF16 dot products (`medium`'s experts,
# cold: 30 against 28 GB/s at 2 rows, 31 against 25 at 1; docs/performance.md)
FUSED_AMX_MIN_MEAN_ROWS = 2


class ExpertExecutor(Protocol):
    """forward(x [T, H], topk_weights [T, k] float32, topk_ids [T, k] int64, keep [T, k] bool
    or None) -> [T, H] float32: sum over k (where `keep`) of topk_weights[t, k] *
    expert_{topk_ids[t, k]}(x[t]). `keep` comes from an approximate expert mode
    (`SparseMoE.modifier`); the store's `on_route` still sees every pair (a dropped pair
    carries its token's top-1 expert and weight 0).

    `row_tile` > 0: batch-invariant mode (see `linear`); `fused`: the fused CPU kernel
    (`moestream/kernels/fused_moe.py`) runs a layer whose active experts have at most
    `FUSED_MAX_MEAN_ROWS` rows on average. Both are set per model."""

    row_tile: int
    fused: bool

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor: ...


def expert_swiglu(x: torch.Tensor, w: ExpertWeights | PackedExpert, row_tile: int = 0,
                  act: ExpertActivation = SWIGLU, bias: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One expert's gated MLP on its rows: x [n, H] -> down(act(gate_up(x))) [n, H], x's dtype
    (`gated_activation`: SwiGLU by default). `bias`: the expert's (gate_up [2I], down [H])
    biases, added after each matmul (transformers' `GptOssExperts`: `x @ W + b`). A packed
    (quantized) expert is dequantized to x's dtype first, into a scratch of one expert that
    is freed when this returns."""
    if isinstance(w, PackedExpert):
        w = dequantize_expert(w, x.dtype)
    y = linear(x, w.gate_up, row_tile=row_tile)  # [n, 2I]
    if bias is not None:
        y = y + bias[0]
    out = linear(gated_activation(y, act), w.down, row_tile=row_tile)  # [n, H]
    return out + bias[1] if bias is not None else out


class ExpertBias(nn.Module):
    """The biases of one MoE layer's routed experts (gpt-oss), resident whatever the expert
    budget: gate_up_proj_bias [E, 2I] and down_proj_bias [E, H] in the model dtype (HF's
    names; E * (2I + H) values, against 3 * I * H per expert for the weights)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size), requires_grad=False)

    def of(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `expert`'s (gate_up [2I], down [H]) biases."""
        return self.gate_up_proj_bias[expert], self.down_proj_bias[expert]


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, keep: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, k) pairs by expert: topk_ids [T, k] int64 ->
    (order [T*k]: pair indices sorted by expert id, stable (a token's pairs keep their k
    order); token_of [T*k]: the token row of each sorted pair; counts [E]: pairs per expert).
    `keep` [T, k] bool (an approximate expert mode's choice): pairs where it is False sort
    after every expert's and are left out of `counts`, so nothing computes them."""
    flat_ids = topk_ids.flatten()  # [T*k]
    if keep is not None:
        flat_ids = flat_ids.masked_fill(~keep.flatten(), num_experts)
    order = torch.argsort(flat_ids, stable=True)  # [T*k]
    return order, order // topk_ids.shape[1], torch.bincount(flat_ids, minlength=num_experts)[:num_experts]


def fused_applies(fused: bool, row_tile: int, x: torch.Tensor, counts: list[int]) -> bool:
    """Whether the fused kernel runs this layer: turned on, not batch-invariant, on CPU in
    float32 or bf16, with at most `FUSED_MAX_MEAN_ROWS` rows per active expert on average
    (`FUSED_MAX_MEAN_ROWS_AMX` where its bf16 projections take AMX tiles; counts: pairs per
    expert, all E of them)."""
    if not fused or row_tile or x.device.type != "cpu" or x.dtype not in FUSED_MAX_MEAN_ROWS:
        return False
    active = sum(1 for c in counts if c)
    return active > 0 and sum(counts) <= fused_max_mean_rows(x.dtype, x.shape[-1]) * active


def fused_amx(x: torch.Tensor, counts: list[int]) -> bool:
    """Whether the fused kernel's bf16 projections take AMX tiles in this layer call: where
    the CPU has them (`has_amx`) and the call's pairs average more than
    `FUSED_AMX_MIN_MEAN_ROWS` per active expert (counts: pairs per expert, all E of them).
    Decided on the whole layer call, so that a paged executor's waves decide as the resident
    executor does, and the outputs stay equal bit for bit."""
    if x.dtype != torch.bfloat16 or not has_amx():
        return False
    return sum(counts) > FUSED_AMX_MIN_MEAN_ROWS * sum(1 for c in counts if c)


def fused_max_mean_rows(dtype: torch.dtype, hidden_size: int) -> int:
    """The most rows per active expert, on average, at which the fused kernel runs a layer of
    this compute dtype (one of `FUSED_MAX_MEAN_ROWS`'s) and hidden size."""
    if dtype == torch.bfloat16 and hidden_size % 32 == 0 and has_amx():
        return FUSED_MAX_MEAN_ROWS_AMX
    return FUSED_MAX_MEAN_ROWS[dtype]


FusedOperands = list[ExpertWeights] | list[tuple[list[IntWeights], IntWeights]]


def _run_fused(x: torch.Tensor, token_of: torch.Tensor, pair_weight: torch.Tensor, starts: list[int],
               counts: list[int], experts: list[int], weights: FusedOperands, act: ExpertActivation,
               bias: ExpertBias | None, out: torch.Tensor, amx: bool) -> torch.Tensor:
    """`fused_moe` (dense weights) or `fused_moe_int` (integer experts, `int_expert`'s) over
    `experts` (ascending ids; their sorted pairs are token_of[starts[e]: starts[e + 1]],
    contiguous since the ids ascend) with `weights` in the same order (`_fused_operands`);
    adds into out [T, H] float32 and returns it."""
    lo, hi = starts[experts[0]], starts[experts[-1] + 1]
    b = None if bias is None else ([bias.gate_up_proj_bias[e] for e in experts],
                                    [bias.down_proj_bias[e] for e in experts])
    args = (token_of[lo:hi], pair_weight[lo:hi].contiguous(), [counts[e] for e in experts], ACT_CODES[act.name],
            act.alpha, act.limit, out)
    if isinstance(weights[0], ExpertWeights):
        return fused_moe(x.contiguous(), [w.gate_up for w in weights], [w.down for w in weights], b, *args, amx=amx)
    return fused_moe_int(x.contiguous(), weights, b, *args, amx=amx)


def _fused_operands(weights: list[ExpertWeights | PackedExpert], dtype: torch.dtype) -> FusedOperands | None:
    """What the fused kernel reads for these experts: the weights themselves when unpacked,
    contiguous and in `dtype`; each packed expert's integer matrices (`int_expert`) when its
    format has them; else None (the per-expert path)."""
    if all(isinstance(w, ExpertWeights) and w.gate_up.dtype == dtype and w.gate_up.is_contiguous()
           and w.down.is_contiguous() for w in weights):
        return weights
    if all(isinstance(w, PackedExpert) for w in weights):
        ints = [int_expert(w) for w in weights]
        if all(i is not None for i in ints):
            return ints
    return None


@functools.cache
def grouped_mm_matches_linear(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `torch._grouped_mm` computes each group exactly as `linear` computes that
    expert's rows: on CPU, where it runs one `mm` per group, in float32, and in bf16/fp16
    where the CPU has native bf16 matmul (elsewhere `linear` upcasts calls of 8+ rows)."""
    if device.type != "cpu" or not hasattr(torch, "_grouped_mm"):
        return False
    probe = torch.empty(0, device=device)
    return dtype == torch.float32 or (dtype == torch.bfloat16 and not upcasts(probe, probe.to(dtype)))


class ResidentExpertExecutor:
    """All experts of one layer on the device: gate_up [E, 2I, H], down [E, H, I] (the
    `ResidentExpertStore`'s stacked tensors, read at each call: the loader fills them after
    the model is built). Grouped matmuls where they equal `linear` per expert
    (`grouped_mm_matches_linear`), else the per-expert loop of the paged executor.

    Raises:
        KeyError: from forward, when the store has no experts for this layer.
    """

    row_tile = 0
    fused = False

    def __init__(self, store: ResidentExpertStore, layer_idx: int, num_experts: int,
                 act: ExpertActivation = SWIGLU, bias: ExpertBias | None = None) -> None:
        self.store, self.layer_idx, self.num_experts = store, layer_idx, num_experts
        self.act, self.bias = act, bias
        self.grouped: bool | None = None  # grouped_mm_matches_linear for the first call's dtype and device
        self._views: tuple[int, list[ExpertWeights]] | None = None  # (gate_up's data_ptr, per-expert views)

    def _expert_views(self, gate_up: torch.Tensor, down: torch.Tensor) -> list[ExpertWeights]:
        """Per-expert views of the stacked weights, made once (again if the store's tensors change)."""
        if self._views is None or self._views[0] != gate_up.data_ptr():
            self._views = (gate_up.data_ptr(), [ExpertWeights(g, d) for g, d in zip(gate_up.unbind(0), down.unbind(0))])
        return self._views[1]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        self.store.on_route(self.layer_idx, topk_ids, topk_weights)
        if self.store.layout is not None:  # packed experts: dequantized one at a time, as the paged executor does
            order, token_of, counts = sort_by_expert(topk_ids, self.num_experts, keep)
            counts_list = counts.tolist()
            active = [e for e, c in enumerate(counts_list) if c]
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
            ensured = self.store.ensure(self.layer_idx, active)
            pair_weight = topk_weights.flatten()[order]  # [T*k]
            if fused_applies(self.fused, self.row_tile, x, counts_list):
                operands = _fused_operands(ensured, x.dtype)
                if operands is not None:
                    return _run_fused(x, token_of, pair_weight, [0, *itertools.accumulate(counts_list)], counts_list,
                                      active, operands, self.act, self.bias, out, fused_amx(x, counts_list))
            experts = dict(zip(active, ensured))
            return _loop(x, token_of, pair_weight, counts_list, active, experts.__getitem__, self.row_tile, out,
                         self.act, self.bias)
        gate_up, down = self.store.layer_weights(self.layer_idx)  # [E, 2I, H], [E, H, I]
        if self.grouped is None:  # decided once, outside any trace (the CPU probe cannot be traced)
            # torch._grouped_mm needs its operands' row strides in multiples of 16 bytes
            aligned = all(d * down.element_size() % 16 == 0 for d in down.shape[1:])
            self.grouped = aligned and grouped_mm_matches_linear(x.dtype, x.device)
        order, token_of, counts = sort_by_expert(topk_ids, self.num_experts, keep)
        pair_weight = topk_weights.flatten()[order]  # [T*k]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        if self.fused and gate_up.dtype == x.dtype:
            counts_list = counts.tolist()
            if fused_applies(self.fused, self.row_tile, x, counts_list):
                active = [e for e, c in enumerate(counts_list) if c]
                views = self._expert_views(gate_up, down)
                return _run_fused(x, token_of, pair_weight, [0, *itertools.accumulate(counts_list)], counts_list,
                                  active, [views[e] for e in active], self.act, self.bias, out,
                                  fused_amx(x, counts_list))
        # Fewer pairs than half the experts (decode of one or two sequences): torch's CPU
        # grouped matmul walks every group, empty ones too, so the loop over the few active
        # experts is faster there (both compute each expert alike).
        # So does a dropped pair (`keep`): the grouped path would need its row count on the host.
        if (self.row_tile or topk_ids.numel() * 2 < self.num_experts
                or not self.grouped or keep is not None):
            counts_list = counts.tolist()
            active = [e for e, c in enumerate(counts_list) if c]
            return _loop(x, token_of, pair_weight, counts_list, active,
                         lambda e: ExpertWeights(gate_up[e], down[e]), self.row_tile, out, self.act, self.bias)
        pairs, t = topk_ids.numel(), x.shape[0]
        expert_of = topk_ids.flatten()[order]  # [T*k] the expert of each sorted pair
        if pairs > ONEDNN_ROW_BUCKET and buckets_rows(x, gate_up):
            # Each expert's group padded to `bucket_rows` of its count, as `linear` pads a
            # call. The row count is read on the host: this path only runs on CPU.
            padded = torch.where(counts > ONEDNN_ROW_BUCKET, (counts + ONEDNN_ROW_BUCKET - 1)
                                 // ONEDNN_ROW_BUCKET * ONEDNN_ROW_BUCKET, counts)  # [E]
            offsets = torch.cumsum(padded, 0, dtype=torch.int32)  # [E] end row of each padded group
            shift = (offsets - padded) - (torch.cumsum(counts, 0) - counts)  # [E] padded start - start
            dest = torch.arange(pairs, device=x.device) + shift[expert_of]  # [T*k] padded row
            target = torch.full((int(offsets[-1]),), t, dtype=token_of.dtype, device=x.device)  # [P]
            target[dest] = token_of  # the token of each padded row; t (a zero row) for padding
            weight = pair_weight.new_zeros(target.shape).index_copy_(0, dest, pair_weight)  # [P]
            rows = torch.cat([x, x.new_zeros(1, x.shape[1])])[target]  # [P, H] grouped by expert
            out = x.new_zeros(t + 1, x.shape[1], dtype=torch.float32)  # [T + 1, H]; row t takes the padding
            # padding rows take the bias of the group before (weight 0, row t: never read)
            expert_of = torch.searchsorted(offsets, torch.arange(len(target), dtype=offsets.dtype, device=x.device),
                                           right=True)
        else:
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] end row of each expert's group
            target, weight, rows = token_of, pair_weight, x[token_of]  # [T*k], [T*k], [T*k, H]
        h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets)  # [P, 2I]
        if self.bias is not None:  # added after the matmul, as `expert_swiglu` adds it
            h = h + self.bias.gate_up_proj_bias[expert_of]
        y = torch._grouped_mm(gated_activation(h, self.act), down.transpose(1, 2), offs=offsets)  # [P, H]
        if self.bias is not None:
            y = y + self.bias.down_proj_bias[expert_of]
        return weighted_sum(out, target, y, weight)[:t]


def weighted_sum(out: torch.Tensor, target: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out [T, H] float32 += weight[i] * y[i] at row target[i], for y [P, H] (any float dtype),
    target [P] int64 and weight [P] float32; returns out. Runs in chunks of `COMBINE_CHUNK`
    rows so that the float32 temporaries stay small: made in one piece, a prefill's [T*k, H]
    float32 products (16 MB on `small`) took 15-30 ms per layer in the profile (upcast and
    multiply). Each row's sum is taken in index order either way, so chunks do not change it."""
    for c in range(0, y.shape[0], COMBINE_CHUNK):
        rows = slice(c, c + COMBINE_CHUNK)
        out.index_add_(0, target[rows], y[rows].float() * weight[rows, None])
    return out


class PagedExpertExecutor:
    """Experts paged by an `ExpertStore`: `on_route`, then `ensure` in waves of at most
    `max_experts_per_call()` experts, each expert's rows through `expert_swiglu`.
    `lookahead` = (next MoE layer index, its router), set by the model: with the store's
    `lookahead` on, the next layer's experts are predicted from this layer's input and
    prefetched once the first wave is resident."""

    row_tile = 0
    fused = False

    def __init__(self, store: ExpertStore, layer_idx: int, num_experts: int, act: ExpertActivation = SWIGLU,
                 bias: ExpertBias | None = None) -> None:
        self.store, self.layer_idx, self.num_experts = store, layer_idx, num_experts
        self.act, self.bias = act, bias
        self.lookahead: tuple[int, torch.nn.Module] | None = None
        # a `begin` that `forward` continues: its topk_ids and their sort_by_expert
        self._begun: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def begin(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Report the routing and start loading the first wave of experts (`store.start`): the
        disk reads run while the caller computes (SparseMoE: the shared experts). A `forward`
        with the same `topk_ids` tensor continues it; the output is the same as without."""
        self.store.on_route(self.layer_idx, topk_ids, topk_weights)
        self._begun = (topk_ids, sort_by_expert(topk_ids, self.num_experts, keep))
        active = [e for e, c in enumerate(self._begun[1][2].tolist()) if c]
        self.store.start(self.layer_idx, active[: self.store.max_experts_per_call()])

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        begun, self._begun = self._begun, None
        if begun is not None and begun[0] is topk_ids:
            order, token_of, counts = begun[1]
        else:
            self.store.on_route(self.layer_idx, topk_ids, topk_weights)
            order, token_of, counts = sort_by_expert(topk_ids, self.num_experts, keep)
        pair_weight = topk_weights.flatten()[order]  # [T*k]
        counts_list = counts.tolist()
        active = [e for e, c in enumerate(counts_list) if c]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        fused = fused_applies(self.fused, self.row_tile, x, counts_list)
        amx = fused_amx(x, counts_list)  # for the whole call: every wave decides alike
        starts = [0, *itertools.accumulate(counts_list)]
        wave = self.store.max_experts_per_call()
        for w0 in range(0, len(active), wave):  # more experts than slots: run in waves
            chunk = active[w0 : w0 + wave]
            ensured = self.store.ensure(self.layer_idx, chunk)
            if w0 == 0 and self.lookahead is not None and self.store.lookahead:
                self._prefetch_next_layer(x)
            operands = _fused_operands(ensured, x.dtype) if fused else None
            if operands is not None:
                _run_fused(x, token_of, pair_weight, starts, counts_list, chunk, operands, self.act, self.bias, out, amx)
            else:
                weights = dict(zip(chunk, ensured))
                _loop(x, token_of, pair_weight, counts_list, chunk, weights.__getitem__, self.row_tile, out,
                      self.act, self.bias)
        return out

    def _prefetch_next_layer(self, x: torch.Tensor) -> None:
        """Gate lookahead: the next MoE layer's router applied to this layer's input x [T, H]. The
        predicted experts are ranked by their summed choice score over the tokens that pick them,
        and the first top_k are prefetched, best first: one token's worth of reads per layer, so
        that at larger batches the prefetch does not fill the disk with unlikely experts."""
        next_layer, router = self.lookahead
        choice = router.choice_scores(router.scores(x))  # [T, E] float32
        predicted = router.select(choice)  # [T, k]
        mass = torch.zeros(choice.shape[1], dtype=torch.float32).index_add_(
            0, predicted.flatten(), choice.gather(1, predicted).flatten().float())  # [E]
        picked = torch.bincount(predicted.flatten(), minlength=choice.shape[1]) > 0  # [E] bool
        mass = mass.masked_fill(~picked, float("-inf"))  # noaux_tc's choice scores may be negative
        ranked = torch.argsort(mass, descending=True, stable=True)[: min(router.top_k, int(picked.sum()))]
        self.store.prefetch(next_layer, ranked.tolist())


def _loop(x: torch.Tensor, token_of: torch.Tensor, pair_weight: torch.Tensor, counts: list[int],
          experts: list[int], weights_of: Callable[[int], ExpertWeights | PackedExpert], row_tile: int,
          out: torch.Tensor, act: ExpertActivation = SWIGLU, bias: ExpertBias | None = None) -> torch.Tensor:
    """The per-expert loop: each expert of `experts` (ascending ids), its rows of the sorted
    pairs (token_of [T*k], pair_weight [T*k]; counts: pairs per expert) through
    `expert_swiglu` (with `act` and the layer's `bias`), added with their weights into
    out [T, H] float32, which it returns. `weights_of(e)` gives expert e's weights."""
    starts = [0, *itertools.accumulate(counts)]  # [E + 1]
    for e in experts:
        start, end = starts[e], starts[e + 1]
        rows = token_of[start:end]  # [n]
        y = expert_swiglu(x[rows], weights_of(e), row_tile, act, None if bias is None else bias.of(e))  # [n, H]
        weighted_sum(out, rows, y, pair_weight[start:end])
    return out


def make_expert_executor(store: ExpertStore, layer_idx: int, num_experts: int, act: ExpertActivation = SWIGLU,
                         bias: ExpertBias | None = None) -> ExpertExecutor:
    """The executor for a layer's experts (gated activation `act`, optional per-expert
    biases): resident when the store holds them all."""
    if isinstance(store, ResidentExpertStore):
        return ResidentExpertExecutor(store, layer_idx, num_experts, act, bias)
    return PagedExpertExecutor(store, layer_idx, num_experts, act, bias)
