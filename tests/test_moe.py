"""SparseMoE: grouped execution asks the store only for experts that received tokens, and
equals a naive per-token loop."""

import torch
import torch.nn.functional as F

from moestream.experts.resident import ResidentExpertStore
from moestream.layers.moe import SparseMoE


class RecordingStore(ResidentExpertStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, list[int]]] = []

    def ensure(self, layer, expert_ids):
        self.calls.append((layer, list(expert_ids)))
        return super().ensure(layer, expert_ids)


def test_grouped_experts_match_naive_and_skip_idle_experts() -> None:
    torch.manual_seed(0)
    H, I, E, K, T = 16, 8, 6, 2, 5
    store = RecordingStore()
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    store.set_layer(3, gate_up, down)
    moe = SparseMoE(H, E, K, norm_topk_prob=True, layer_idx=3, store=store)
    with torch.no_grad():
        moe.gate.weight.normal_()
        moe.gate.weight[4] = -100.0  # expert 4 never wins a token
    x = torch.randn(T, H).abs() + 0.1  # positive, so that expert 4's all-negative gate row loses
    with torch.no_grad():
        y = moe(x)
        weights, ids = moe.route(x)
    assert store.calls == [(3, sorted(set(ids.flatten().tolist())))]
    assert 4 not in store.calls[0][1]
    ref = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            e = ids[t, k].item()
            g, u = (gate_up[e] @ x[t]).chunk(2)
            ref[t] += weights[t, k] * (down[e] @ (F.silu(g) * u))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(T))  # norm_topk_prob renormalises
