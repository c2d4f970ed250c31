"""Expert hits of a fully resident store: counted as the paged store counts them (one per
distinct expert a layer's forward routes to), so `/metrics` no longer shows
`expert_hits_total 0` beside `expert_hit_rate 1.0`."""

from __future__ import annotations

from conftest import API_KEY, SERVED_MODEL, parity_prompts
from live_server import LiveServer
from prometheus_client.parser import text_string_to_metric_families

from moestream import LLM, SamplingParams
from moestream.models.hf_config import model_config_from_hf

NUM_TOKENS = 6


def expected_hits(model_dir: str, num_forwards: int) -> int:
    """Hits of `num_forwards` forward passes of one token each: top_k distinct experts per
    MoE layer per pass."""
    cfg = model_config_from_hf(model_dir)
    return num_forwards * cfg.num_experts_per_tok * sum(cfg.moe_layers)


def one_token_request(max_tokens: int) -> tuple[dict, SamplingParams]:
    """A 1-token prompt and greedy params for `max_tokens` tokens: `max_tokens` forwards of one
    token (the prompt's, then each sampled token but the last)."""
    return {"prompt_token_ids": [100]}, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_resident_hits_offline(qwen3_moe_dir: str) -> None:
    llm = LLM(qwen3_moe_dir, dtype="float32", max_model_len=96)
    assert llm.expert_stats()["hits"] == 0  # nothing run yet
    out = llm.generate(*one_token_request(NUM_TOKENS))[0]
    assert len(out.outputs[0].token_ids) == NUM_TOKENS
    stats = llm.expert_stats()
    assert stats["resident"] is True and stats["hit_rate"] == 1.0 and stats["misses"] == 0
    assert stats["hits"] == expected_hits(qwen3_moe_dir, NUM_TOKENS) > 0


def test_resident_hits_equal_paged_accesses(qwen3_moe_dir: str) -> None:
    """Same routing (the outputs are bit-identical at any budget): each resident hit is a paged
    hit or miss."""
    prompts = [{"prompt_token_ids": p} for p in parity_prompts()[:4]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    counts = []
    for budget in (1.0, 0.5):
        llm = LLM(qwen3_moe_dir, dtype="float32", max_model_len=96, expert_budget=budget)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.expert_stats()
        counts.append((tokens, stats["resident"], stats["hits"], stats["misses"]))
    (res_tokens, resident, res_hits, res_misses), (paged_tokens, paged_resident, hits, misses) = counts
    assert resident and not paged_resident and res_tokens == paged_tokens
    assert res_misses == 0 and misses > 0
    assert res_hits == hits + misses


def test_metrics_count_resident_hits(live_server: LiveServer, qwen3_moe_dir: str) -> None:
    def hits_and_rate() -> tuple[float, float]:
        live_server.wait_idle()
        r = live_server.get("/metrics")
        samples = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
        return samples["moestream:expert_hits_total"], samples["moestream:expert_hit_rate"]

    before, _ = hits_and_rate()
    r = live_server.post("/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                         json={"model": SERVED_MODEL, "prompt": [100], "max_tokens": NUM_TOKENS, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == NUM_TOKENS
    after, rate = hits_and_rate()
    assert after - before == expected_hits(qwen3_moe_dir, NUM_TOKENS) > 0
    assert rate == 1.0
