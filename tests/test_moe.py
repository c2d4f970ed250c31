"""SparseMoE and its expert executors: the paged executor asks the store only for experts
that received tokens, in waves of the store's slots; the resident executor's grouped
matmuls equal the per-expert loop bit for bit; both equal a naive per-token sum."""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from moestream.experts.resident import ResidentExpertStore
from moestream.layers.expert_executor import (
    PagedExpertExecutor,
    ResidentExpertExecutor,
    grouped_mm_matches_linear,
)
from moestream.layers.linear import linear
from moestream.layers.moe import SparseMoE


class RecordingStore:
    """A paged-style store over resident tensors: records `ensure` calls, serves at most
    `slots` experts per call."""

    lookahead = False

    def __init__(self, inner: ResidentExpertStore, slots: int = 1 << 30) -> None:
        self.inner, self.slots = inner, slots
        self.calls: list[tuple[int, list[int]]] = []
        self.routed: list[torch.Tensor] = []
        self.prefetched: list[tuple[int, list[int]]] = []

    def ensure(self, layer, expert_ids):
        assert len(expert_ids) <= self.slots
        self.calls.append((layer, list(expert_ids)))
        return self.inner.ensure(layer, expert_ids)

    def max_experts_per_call(self) -> int:
        return self.slots

    def start(self, layer, expert_ids) -> None:
        pass

    def on_route(self, layer, topk_ids, topk_weights) -> None:
        self.routed.append(topk_ids.clone())

    def prefetch(self, layer, expert_ids) -> None:
        self.prefetched.append((layer, list(expert_ids)))

    def hint(self, layer, expert_ids) -> None:
        pass

    def resident_view(self, layer):
        return self.inner.resident_view(layer)


def _naive(x, weights, ids, gate_up, down):
    ref = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k].item()
            g, u = (gate_up[e] @ x[t]).chunk(2)
            ref[t] += weights[t, k] * (down[e] @ (F.silu(g) * u))
    return ref


def test_paged_executor_asks_only_for_active_experts_and_matches_naive() -> None:
    torch.manual_seed(0)
    H, I, E, K, T = 16, 8, 6, 2, 5
    inner = ResidentExpertStore()
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    inner.set_layer(3, gate_up, down)
    store = RecordingStore(inner)
    moe = SparseMoE(H, E, K, norm_topk_prob=True, layer_idx=3, store=store)
    assert isinstance(moe.experts, PagedExpertExecutor)
    with torch.no_grad():
        moe.gate.weight.normal_()
        moe.gate.weight[4] = -100.0  # expert 4 never wins a token
    x = torch.randn(T, H).abs() + 0.1  # positive, so that expert 4's all-negative gate row loses
    with torch.no_grad():
        y = moe(x)
        weights, ids = moe.route(x)
    assert store.calls == [(3, sorted(set(ids.flatten().tolist())))]
    assert 4 not in store.calls[0][1]
    assert torch.equal(store.routed[0], ids)
    torch.testing.assert_close(y, _naive(x, weights, ids, gate_up, down), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(T))  # norm_topk_prob renormalises


@pytest.mark.parametrize("tokens", [1, 7])
def test_gate_lookahead_prefetches_the_top_k_predicted_experts_best_first(tokens: int) -> None:
    """Gate lookahead: the next layer's router on this layer's input predicts each token's top-k;
    the store is asked for at most k of them, ranked by their summed score over the tokens that
    chose them (one token: exactly its top-k, best first)."""
    torch.manual_seed(1)
    H, I, E, K = 16, 8, 12, 3
    inner = ResidentExpertStore()
    inner.set_layer(0, torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    store = RecordingStore(inner)
    store.lookahead = True
    moe, nxt = (SparseMoE(H, E, K, norm_topk_prob=True, layer_idx=i, store=store) for i in (0, 1))
    with torch.no_grad():
        nxt.gate.weight.normal_()
    moe.set_lookahead(1, nxt.gate)
    x = torch.randn(tokens, H)
    with torch.no_grad():
        moe(x)
        scores = nxt.gate.scores(x)  # [T, E]
    top = scores.topk(K, dim=-1)
    mass = torch.zeros(E).index_add_(0, top.indices.flatten(), top.values.flatten())
    want = [e for e in mass.argsort(descending=True).tolist() if mass[e] > 0][:K]
    assert store.prefetched == [(1, want)]
    if tokens == 1:
        assert want == top.indices[0].tolist()


def _old_loop(x, weights, ids, gate_up, down):
    """The per-expert loop SparseMoE ran before the executors (kept here as the reference)."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    token_of, pair_w = order // ids.shape[1], weights.flatten()[order]
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    out, start = torch.zeros(x.shape, dtype=torch.float32), 0
    for e, c in enumerate(counts):
        if not c:
            continue
        rows = token_of[start : start + c]
        g, u = linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        y = linear(F.silu(g) * u, down[e])
        out.index_add_(0, rows, y.float() * pair_w[start : start + c, None])
        start += c
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 16, 70, 200])
def test_resident_executor_equals_per_expert_loop_bitwise(dtype: torch.dtype, tokens: int) -> None:
    """Random routing (some experts idle, some with many rows): the resident executor (grouped
    matmuls where they equal `linear`) and the paged executor in waves of 3 experts give the
    old per-expert loop's output bit for bit."""
    torch.manual_seed(tokens)
    H, I, E, K = 64, 32, 12, 4
    gate_up = (torch.randn(E, 2 * I, H) / H**0.5).to(dtype)
    down = (torch.randn(E, H, I) / I**0.5).to(dtype)
    store = ResidentExpertStore()
    store.set_layer(0, gate_up, down)
    x = torch.randn(tokens, H).to(dtype)
    hot = torch.randperm(E)[: E - 3]  # three experts get no tokens
    ids = torch.stack([hot[torch.randperm(len(hot))[:K]] for _ in range(tokens)])  # [T, K]
    weights = torch.rand(tokens, K)
    ref = _old_loop(x, weights, ids, gate_up, down)
    resident = ResidentExpertExecutor(store, 0, E).forward(x, weights, ids)
    paged = PagedExpertExecutor(RecordingStore(store, slots=3), 0, E).forward(x, weights, ids)
    assert torch.equal(resident, ref)
    assert torch.equal(paged, ref)
    torch.testing.assert_close(ref, _naive(x.float(), weights, ids, gate_up.float(), down.float()),
                               rtol=0.05 if dtype == torch.bfloat16 else 1e-5, atol=0.05 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 70, 200])
def test_biased_swigluoai_resident_equals_paged_bitwise(dtype: torch.dtype, tokens: int) -> None:
    """gpt-oss's experts (clamped, interleaved "swigluoai" with per-expert biases): the resident
    executor's grouped matmuls, with the biases gathered per row (padded row buckets at 200
    tokens in bf16), equal the paged per-expert loop bit for bit, and both equal a naive
    per-token sum of transformers' formula."""
    from moestream.config import ExpertActivation
    from moestream.layers.expert_executor import ExpertBias

    torch.manual_seed(tokens)
    H, I, E, K = 64, 32, 12, 4
    act = ExpertActivation("swigluoai", 1.702, 1.0, bias=True)
    gate_up = (torch.randn(E, 2 * I, H) / H**0.5).to(dtype)
    down = (torch.randn(E, H, I) / I**0.5).to(dtype)
    bias = ExpertBias(E, H, I)
    bias.gate_up_proj_bias.data = (0.3 * torch.randn(E, 2 * I)).to(dtype)
    bias.down_proj_bias.data = (0.3 * torch.randn(E, H)).to(dtype)
    store = ResidentExpertStore()
    store.set_layer(0, gate_up, down)
    x = torch.randn(tokens, H).to(dtype)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(tokens)])  # [T, K]
    weights = torch.rand(tokens, K)
    resident_exec = ResidentExpertExecutor(store, 0, E, act, bias)
    resident = resident_exec.forward(x, weights, ids)
    paged = PagedExpertExecutor(RecordingStore(store, slots=3), 0, E, act, bias).forward(x, weights, ids)
    assert resident_exec.grouped is grouped_mm_matches_linear(dtype, torch.device("cpu"))
    assert torch.equal(resident, paged)
    ref = torch.zeros(tokens, H)
    for t in range(tokens):
        for k in range(K):
            e = ids[t, k].item()
            h = gate_up[e].float() @ x[t].float() + bias.gate_up_proj_bias[e].float()
            gate, up = h[0::2].clamp(max=1.0), h[1::2].clamp(-1.0, 1.0)
            y = down[e].float() @ ((up + 1) * gate * torch.sigmoid(1.702 * gate)) + bias.down_proj_bias[e].float()
            ref[t] += weights[t, k] * y
    tol = 0.05 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(resident, ref, rtol=tol, atol=tol)


def test_grouped_matmul_used_on_cpu_float32() -> None:
    """The resident executor's grouped path is the one float32 on CPU takes (so the bitwise test
    above tests it), and never in the batch-invariant mode's row tiles."""
    assert grouped_mm_matches_linear(torch.float32, torch.device("cpu"))
    assert not grouped_mm_matches_linear(torch.float32, torch.device("meta"))


def test_resident_grouped_path_traces_as_one_graph() -> None:
    """Where the resident executor takes its grouped path (bf16 on a CPU with native bf16:
    torch's `_grouped_mm` shape checks accept only bf16 when traced), it has no host sync and
    no data-dependent Python: torch.compile traces it whole (`fullgraph=True` raises on any
    graph break, such as a `.tolist()`) and the traced graph computes the same values. Where
    it loops over experts instead, tracing it whole fails on that loop's host sync."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    H, I, E, K, T = 32, 16, 8, 2, 6
    store = ResidentExpertStore()
    store.set_layer(0, (torch.randn(E, 2 * I, H) / H**0.5).bfloat16(), (torch.randn(E, H, I) / I**0.5).bfloat16())
    executor = ResidentExpertExecutor(store, 0, E)
    x, weights = torch.randn(T, H).bfloat16(), torch.rand(T, K)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])  # [T, K]; 12 pairs >= E / 2: grouped
    eager = executor.forward(x, weights, ids)  # decides the path once, outside the trace
    assert executor.grouped == grouped_mm_matches_linear(torch.bfloat16, torch.device("cpu"))
    compiled = torch.compile(executor.forward, backend="eager", fullgraph=True)
    try:
        if executor.grouped:
            torch.testing.assert_close(compiled(x, weights, ids), eager, rtol=0, atol=0)
        else:
            # the loop's per-expert row counts come from the host (`.tolist()`)
            with pytest.raises((torch._dynamo.exc.Unsupported, GuardOnDataDependentSymNode)):
                compiled(x, weights, ids)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(48, 96, 10, 3, 123), (48, 100, 10, 4, 120)])
def test_paged_equals_resident_when_silu_tails_differ(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Regression: the resident executor ran F.silu once over all experts' rows and the paged
    one per expert, so an element could take torch's scalar tail in one and the SIMD loop in
    the other (369 pairs x 96: one call split between 2 threads at an offset that is not a
    multiple of the vector step), and float32 logprobs changed with the expert budget. Both
    use the aligned silu now. An intermediate width of 100 in bf16 (rows not a multiple of 16
    bytes) takes the per-expert loop: torch's grouped matmul raised on it."""
    H, I, E, K, T = shape
    torch.manual_seed(7)
    gate_up = (3 * torch.randn(E, 2 * I, H) / H**0.5).to(dtype)
    down = (torch.randn(E, H, I) / I**0.5).to(dtype)
    store = ResidentExpertStore()
    store.set_layer(0, gate_up, down)
    x = torch.randn(T, H).to(dtype)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])  # [T, K]
    weights = torch.rand(T, K)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        resident = ResidentExpertExecutor(store, 0, E).forward(x, weights, ids)
        paged = PagedExpertExecutor(RecordingStore(store, slots=3), 0, E).forward(x, weights, ids)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(resident, paged)
