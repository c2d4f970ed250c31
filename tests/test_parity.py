"""Token-exact parity with HF transformers float32 for a batch of 8 prompts (lengths 1..40)
decoded together for 32 greedy tokens, under four schedules: all at once, staggered
arrivals, a KV pool small enough to force preemption, and chunked prefill."""

from __future__ import annotations

import torch
from conftest import NUM_NEW_TOKENS, HFReference, parity_prompts
from parity import LogitsRecorder, check_all, greedy_params

from moestream.models.hf_config import model_config_from_hf
from moestream import LLM
from moestream.engine.kv_cache import kv_block_bytes


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], LogitsRecorder]]:
    recs = [LogitsRecorder() for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy_params(r, NUM_NEW_TOKENS) for r in recs])
    return [(o.outputs[0].token_ids, r) for o, r in zip(outs, recs)]


def test_batch_decoded_together(model_dir: str, hf_reference: HFReference) -> None:
    prompts = parity_prompts()
    llm = LLM(model_dir, dtype="float32", max_model_len=128)
    check_all(prompts, _generate(llm, prompts), hf_reference, "batch")


def test_requests_added_mid_decode(model_dir: str, hf_reference: HFReference) -> None:
    prompts = parity_prompts()
    llm = LLM(model_dir, dtype="float32", max_model_len=128)
    engine = llm.llm_engine
    recs = [LogitsRecorder() for _ in prompts]
    final = {}
    order = [0, 5, 2, 7, 1, 4, 6, 3]
    pending = list(order)
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:  # a new request every third step, while others decode
            i = pending.pop(0)
            engine.add_request({"prompt_token_ids": prompts[i]}, greedy_params(recs[i], NUM_NEW_TOKENS), request_id=str(i))
        for out in engine.step():
            if out.finished:
                final[int(out.request_id)] = out.outputs[0].token_ids
        steps += 1
    assert steps > 3 * len(prompts) - 3
    check_all(prompts, [(final[i], recs[i]) for i in range(len(prompts))], hf_reference, "staggered")


def test_preemption(model_dir: str, hf_reference: HFReference) -> None:
    prompts = parity_prompts()
    mc = model_config_from_hf(model_dir)
    block = kv_block_bytes(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.float32)
    # 80 tokens need 5 blocks; 8 requests of up to 72 tokens need ~30. 12 blocks force preemption.
    llm = LLM(model_dir, dtype="float32", max_model_len=80, kv_cache_memory_bytes=12 * block)
    engine = llm.llm_engine
    assert engine.kv_cache.num_blocks == 12
    results = _generate(llm, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.num_free_blocks == 12
    check_all(prompts, results, hf_reference, "preemption")


def test_chunked_prefill(model_dir: str, hf_reference: HFReference) -> None:
    prompts = parity_prompts()
    llm = LLM(model_dir, dtype="float32", max_model_len=128, max_num_batched_tokens=10)
    engine = llm.llm_engine
    recs = [LogitsRecorder() for _ in prompts]
    for p, r in zip(prompts, recs):
        engine.add_request({"prompt_token_ids": p}, greedy_params(r, NUM_NEW_TOKENS))
    final = {}
    partial_prefills = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        partial_prefills += sum(0 < r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
    assert partial_prefills > 0, "no prompt was prefilled in chunks"
    results = [(final[str(i)], recs[i]) for i in range(len(prompts))]
    check_all(prompts, results, hf_reference, "chunked")
