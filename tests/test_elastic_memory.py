"""Elastic memory: expert slots and KV blocks share one page pool. KV demand past the static
split borrows expert slots instead of preempting, they come back when demand falls, and the
output is bit-identical to the fully resident engine whatever the split."""

from __future__ import annotations

import logging

import pytest
import torch
from parity import LogitsRecorder

from moestream import LLM, SamplingParams
from moestream.engine.kv_cache import KVCacheManager

PROMPTS = [{"prompt_token_ids": list(range(10 + i, 40 + i))} for i in range(3)]  # 30 tokens: 2 blocks each


def run(llm: LLM) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    recs = [LogitsRecorder() for _ in PROMPTS]
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=34, ignore_eos=True, logits_processors=[r])
                                  for r in recs])
    return [o.outputs[0].token_ids for o in outs], [r.logits for r in recs]


# (model, expert budget, static KV blocks): pages hold 2 KV blocks on the tiny qwen3_moe, 6 on
# qwen3_next (one attention layer in three)
@pytest.mark.parametrize("model, budget, kv_blocks", [("qwen3_moe", 0.5, 10), ("qwen3_moe", 0.25, 10),
                                                      ("qwen3_next", 0.5, 6)])
def test_kv_demand_borrows_expert_slots_and_gives_them_back(request: pytest.FixtureRequest, model: str,
                                                            budget: float, kv_blocks: int, caplog) -> None:
    """3 requests of 30 + 34 tokens need 12 blocks of 16 tokens; the static KV split holds
    fewer. Without elastic memory a request is preempted; with it, expert slots become KV
    blocks, nothing is preempted, the logits equal the resident engine's, and the slots
    return when the requests finish."""
    model_dir = request.getfixturevalue(f"{model}_dir")
    resident = LLM(model_dir, dtype="float32", max_model_len=96)
    tokens, logits = run(resident)
    block_bytes = resident.llm_engine.kv_cache_block_bytes
    kw = dict(dtype="float32", max_model_len=96, expert_budget=budget, kv_cache_memory_bytes=kv_blocks * block_bytes)
    static = LLM(model_dir, **kw)
    assert run(static)[0] == tokens and static.llm_engine.scheduler.num_preemptions >= 1
    llm = LLM(model_dir, **kw, enable_elastic_memory=True)
    eng = llm.llm_engine
    slots, blocks = eng.expert_store.num_slots, eng.coordinator.kv.num_blocks
    m = eng.elastic_memory.geometry.blocks_per_page
    assert blocks == -(-kv_blocks // m) * m < 12
    with caplog.at_level(logging.INFO, logger="moestream.engine.elastic_memory"):
        ours, our_logits = run(llm)
    assert ours == tokens
    for a, b in zip(our_logits, logits):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert eng.scheduler.num_preemptions == 0
    grown = [r.message for r in caplog.records if f"became {m} KV blocks" in r.message]
    back = [r.message for r in caplog.records if "KV blocks became expert slot" in r.message]
    n = -(-max(12 - blocks, 0) // m)  # pages borrowed at the peak
    assert len(grown) == n > 0 and grown[-1].endswith(f"({slots - n} expert slots, {blocks + n * m} KV blocks now)")
    assert len(back) == n and back[-1].endswith(f"({slots} expert slots, {blocks} KV blocks now)")
    st = llm.expert_stats()
    assert st["num_slots"] == slots and st["elastic_memory"]["resizes"] == 2 * n
    assert eng.coordinator.kv.num_free_blocks == blocks  # nothing leaked


def test_elastic_memory_needs_a_paged_budget(qwen3_moe_dir: str) -> None:
    with pytest.raises(ValueError, match="enable_elastic_memory shares memory"):
        LLM(qwen3_moe_dir, dtype="float32", enable_elastic_memory=True)
    with pytest.raises(ValueError, match="enable_elastic_memory must be True or False"):
        LLM(qwen3_moe_dir, dtype="float32", expert_budget=0.5, enable_elastic_memory="yes")


def test_kv_manager_moves_blocks_in_and_out() -> None:
    kv = KVCacheManager(6, 4, enable_prefix_caching=True, offline_blocks=[4, 5])
    assert kv.num_blocks == 4 and kv.num_free_blocks == 4
    assert kv.allocate_slots("a", 8)  # blocks 0, 1
    kv.cache_blocks("a", list(range(8)), 8)
    assert kv.blocks_short("b", 16) == 2
    assert not kv.remove_free_blocks([1, 2])  # 1 is held: nothing taken
    kv.free("a")
    assert kv.num_cached_blocks == 2
    assert kv.remove_free_blocks([0, 1]) and kv.num_blocks == 2 and kv.num_cached_blocks == 0
    assert kv.stats.evictions == 2
    kv.add_blocks([4, 5])
    assert kv.num_blocks == 4 and kv.num_free_blocks == 4 and kv.blocks_short("b", 16) == 0
    with pytest.raises(ValueError, match="already in the KV cache pool"):
        kv.add_blocks([5])
