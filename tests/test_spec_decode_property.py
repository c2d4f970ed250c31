"""Property test of speculative decoding (hypothesis), on an attention model, a hybrid one
and gpt-oss (full and sliding-window KV cache groups): random arrivals and aborts of requests whose drafts are right for a varying number of
positions (some never, some always), under a 4-block (6 on the hybrid) KV pool (preemptions), chunked prefill,
prefix hits on shared prefixes and, on the hybrid model, 2 device state slots (swaps) and a
one-row checkpoint pool. Afterwards no KV block, state slot, speculative or checkpoint row is
held, and every request that ran to the end produced what it produces alone without drafts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from random_schedule import run_schedule
from scripted_proposer import ScriptedProposer

from moestream import LLM, SamplingParams
from moestream.engine.kv_cache import kv_block_bytes

SHARED = [900 + j for j in range(32)]
PROMPTS = [[5 + i * 7 + j for j in range(n)] for i, n in enumerate((3, 11, 17, 1, 25, 8))] + [
    SHARED[:16] + [7, 8, 9], SHARED + [40, 41], SHARED[:16] + [50] * 12, SHARED + [3]]
MAX_TOKENS = 10
K = 3


def _right(i: int, n: int) -> int:
    """Drafts right for 0..3 positions, varying with the prompt and the output length."""
    return 0 if i == 3 else K if i == 5 else (i * 7 + n * 3) % (K + 1)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next", "gpt_oss"])
def engine_and_solo(request: pytest.FixtureRequest):
    model = request.getfixturevalue(f"{request.param}_dir")
    hybrid = request.param == "qwen3_next"
    if request.param == "gpt_oss":  # two KV cache groups (full, 16-token window) of 2 layers, 4-token blocks
        block = kv_block_bytes(2, 4, 2, 16, torch.float32)
        kw = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=34 * block, max_num_batched_tokens=16,
                  block_size=4)
    else:
        block = kv_block_bytes(1 if hybrid else 3, 16, 2, 16, torch.float32)
        kw = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=(6 if hybrid else 4) * block,
                  max_num_batched_tokens=16)
    if hybrid:
        kw["max_resident_states"] = 2
    plain = LLM(model, enable_prefix_caching=False, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    solo = [plain.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in PROMPTS]
    extra = {}
    if hybrid:
        extra = dict(state_checkpoint_interval=16, max_state_checkpoints=1, state_checkpoint_host_bytes=0)
    llm = LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": K, "adaptive": False},
              **kw, **extra)
    engine = llm.llm_engine
    engine.proposer = ScriptedProposer(list(zip(PROMPTS, solo)), _right, engine.model_config.vocab_size)
    return engine, solo


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    arrivals=st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(0, 8)), min_size=1, max_size=6),
    aborts=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 12)), max_size=2),
)
def test_random_schedules_leak_nothing_and_do_not_change_outputs(engine_and_solo, arrivals, aborts) -> None:
    engine, solo = engine_and_solo
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt_of, finished, aborted = run_schedule(engine, PROMPTS, params, arrivals, aborts)
    kv, coord = engine.kv_cache, engine.coordinator
    assert kv.num_free_blocks == kv.num_blocks and all(kv.ref_count(b) == 0 for b in range(kv.num_blocks))
    assert not (coord._verify or coord._pending or coord._restore or coord._branch or coord._output_ckpt)
    pool = engine.state_pool
    if pool is not None:
        assert pool.num_resident() == 0 and pool.num_swapped() == 0 and pool.num_free_slots == 2
        ckpts = coord.checkpoints
        assert ckpts.num_device() + len(ckpts._free_rows) == 1  # no checkpoint row leaked
    assert not engine.requests
    for rid, tokens in finished.items():
        assert tokens == solo[prompt_of[rid]], f"{rid} (prompt {prompt_of[rid]}) changed with company"
    assert set(finished) | aborted == set(prompt_of)


def test_this_setup_preempts_and_accepts(engine_and_solo) -> None:
    """All prompts at once: the pool forces preemption, and drafts are both accepted and
    rejected (so the property test exercises all of it)."""
    engine, solo = engine_and_solo
    before = dict(engine.spec_decode_stats())
    preempted = engine.scheduler.num_preemptions
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request({"prompt_token_ids": p}, params, request_id=f"all{i}")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[f"all{i}"] for i in range(len(PROMPTS))] == solo
    st_ = engine.spec_decode_stats()
    assert engine.scheduler.num_preemptions > preempted
    accepted = st_["num_accepted_tokens"] - before["num_accepted_tokens"]
    drafted = st_["num_draft_tokens"] - before["num_draft_tokens"]
    assert 0 < accepted < drafted
