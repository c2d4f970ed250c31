"""Property test on a hybrid model of each mixer, GDN, Mamba-2 and KDA (hypothesis): random arrivals, aborts, chunked prefill,
preemptions, state swaps and prefix hits on shared prefixes (a 6-block KV pool, 2 device
state slots, 1 device state checkpoint and 1 on the host, a checkpoint every block).
Afterwards no KV block, state slot or checkpoint row is held or leaked, and every request
that ran to the end produced what it produces alone without prefix caching."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from random_schedule import run_schedule

from moestream import LLM, SamplingParams
from moestream.engine.kv_cache import kv_block_bytes

SHARED = [900 + j for j in range(32)]
PROMPTS = [[5 + i * 7 + j for j in range(n)] for i, n in enumerate((3, 11, 17, 1, 25, 8))] + [
    SHARED[:16] + [7, 8, 9], SHARED + [40, 41], SHARED[:16] + [50] * 12, SHARED + [3]]
MAX_TOKENS = 6


@pytest.fixture(scope="module", params=["qwen3_next", "nemotron_h", "kimi_linear"])  # one per mixer: GDN, Mamba-2, KDA
def engine_and_solo(request: pytest.FixtureRequest):
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    # one attention layer: 2 KV heads of 16, or Kimi-Linear's MLA latent (32 + 8)
    block = kv_block_bytes(1, 16, 1, 40, torch.float32, 0) if request.param == "kimi_linear" else (
        kv_block_bytes(1, 16, 2, 16, torch.float32))
    kw = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=6 * block, max_num_batched_tokens=16,
              max_resident_states=2)
    plain = LLM(model_dir, enable_prefix_caching=False, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    solo = [plain.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    size = plain.llm_engine.state_pool.bytes_per_state
    llm = LLM(model_dir, state_checkpoint_interval=16, max_state_checkpoints=1, state_checkpoint_host_bytes=size,
              **kw)
    return llm.llm_engine, solo


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    arrivals=st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(0, 8)), min_size=1, max_size=6),
    aborts=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 10)), max_size=2),
)
def test_random_schedules_leak_nothing_and_do_not_change_outputs(engine_and_solo, arrivals, aborts) -> None:
    engine, solo = engine_and_solo
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt_of, finished, aborted = run_schedule(engine, PROMPTS, params, arrivals, aborts)
    pool, kv, coord = engine.state_pool, engine.kv_cache, engine.coordinator
    assert kv.num_free_blocks == kv.num_blocks and all(kv.ref_count(b) == 0 for b in range(kv.num_blocks))
    assert pool.num_resident() == 0 and pool.num_swapped() == 0 and pool.num_free_slots == 2
    ckpts = coord.checkpoints
    assert ckpts.num_device() <= 1 and ckpts.num_host() <= 1
    assert ckpts.num_device() + len(ckpts._free_rows) == 1  # no checkpoint row leaked
    assert not (coord._restore or coord._branch or coord._output_ckpt or coord._pending)
    assert not engine.requests
    for rid, tokens in finished.items():
        assert tokens == solo[prompt_of[rid]], f"{rid} (prompt {prompt_of[rid]}) changed with company"
    assert set(finished) | aborted == set(prompt_of)


def test_preemption_happens_in_this_setup(engine_and_solo) -> None:
    """The 6-block pool does force preemption with all prompts at once (so the property test
    exercises it)."""
    engine, solo = engine_and_solo
    before = engine.scheduler.num_preemptions
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request({"prompt_token_ids": p}, params, request_id=f"all{i}")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert engine.scheduler.num_preemptions > before
    assert [done[f"all{i}"] for i in range(len(PROMPTS))] == solo
    assert engine.state_pool.num_free_slots == 2 and engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
