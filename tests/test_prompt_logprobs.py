"""`SamplingParams(prompt_logprobs=k)`: every prompt token's raw logprob, rank and top-k equal
HF float32 teacher-forced log-probabilities, with prefix caching on (a second sighting of
the same prompts), chunked prefill under preemption, and a 25% expert budget."""

from __future__ import annotations

import pytest
import torch
from conftest import HFReference, parity_prompts

from moestream import LLM, SamplingParams
from moestream.models.hf_config import model_config_from_hf
from moestream.engine.kv_cache import kv_block_bytes

ATOL = 1e-4
TOP_K = 3


def teacher_forced(ref: HFReference, prompt: list[int]) -> torch.Tensor:
    """HF's log-probabilities [len(prompt), V] float32 after each prompt position."""
    with torch.no_grad():
        return ref.model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


def check_prompt_logprobs(entries: list, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """entries[0] is None; entry i holds prompt token i's logprob (HF's within ATOL), its rank
    (HF's, up to tokens within ATOL of it) and the top-k, whose logprobs are HF's top-k."""
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        e, row, t = entries[i], ref[i - 1], prompt[i]
        assert next(iter(e)) == t  # vLLM's order: the prompt token first, then the top-k
        assert abs(e[t].logprob - row[t].item()) < ATOL, f"position {i}"
        lo = int((row > row[t] + ATOL).sum()) + 1
        hi = int((row > row[t] - ATOL).sum()) + 1
        assert lo <= e[t].rank <= hi, f"position {i}: rank {e[t].rank}, HF's in [{lo}, {hi}]"
        top = sorted((lp for lp in e.values() if lp.rank <= k), key=lambda lp: lp.rank)
        assert len(top) == k
        assert torch.allclose(torch.tensor([lp.logprob for lp in top]), row.topk(k).values, atol=ATOL)
        assert len(e) in (k, k + 1)  # the top-k, and the prompt token when it is not among them


def engine_kwargs(case: str, model_dir: str) -> dict:
    if case == "chunked_preempted":
        mc = model_config_from_hf(model_dir)
        block = kv_block_bytes(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.float32)
        return {"max_model_len": 80, "kv_cache_memory_bytes": 12 * block, "max_num_batched_tokens": 16}
    if case == "budget_25":
        return {"max_model_len": 80, "expert_budget": 0.25}
    return {"max_model_len": 80}


@pytest.mark.parametrize("case", ["plain", "chunked_preempted", "budget_25"])
def test_prompt_logprobs_equal_hf(model_dir: str, hf_reference: HFReference, case: str) -> None:
    prompts = parity_prompts()
    refs = [teacher_forced(hf_reference, p) for p in prompts]
    llm = LLM(model_dir, dtype="float32", enable_prefix_caching=True, **engine_kwargs(case, model_dir))
    params = SamplingParams(temperature=0.0, max_tokens=32 if case == "chunked_preempted" else 2,
                            prompt_logprobs=TOP_K)
    for sighting in range(2):  # the second finds every prompt's blocks cached, and must not use them
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for out, p, ref in zip(outs, prompts, refs):
            check_prompt_logprobs(out.prompt_logprobs, p, ref, TOP_K)
            assert out.num_cached_tokens == 0
    engine = llm.llm_engine
    if case == "chunked_preempted":
        assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    # the prompt-logprob requests cached their blocks for others: a plain request hits them
    plain = llm.generate({"prompt_token_ids": prompts[-1]}, SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None


def test_prompt_logprobs_zero_and_one_token_prompt(qwen3_moe_dir: str) -> None:
    llm = LLM(qwen3_moe_dir, dtype="float32", max_model_len=64)
    one, three = llm.generate([{"prompt_token_ids": [7]}, {"prompt_token_ids": [7, 8, 9]}],
                              SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert one.prompt_logprobs == [None]
    assert three.prompt_logprobs[0] is None and [list(e) for e in three.prompt_logprobs[1:]] == [[8], [9]]
    with pytest.raises(ValueError, match="prompt_logprobs must be None or an int of at least 0"):
        SamplingParams(prompt_logprobs=-1)


def test_prompt_logprobs_hybrid_equal_hf(hybrid_dir: str, hybrid_reference: HFReference) -> None:
    """Gated DeltaNet models: chunked prefill across the linear layers' states, swapped state
    slots (2 resident), and a second sighting whose prefix (state checkpoints) is cached."""
    prompts = parity_prompts()
    llm = LLM(hybrid_dir, dtype="float32", max_model_len=80, max_num_batched_tokens=16, max_resident_states=2,
              enable_prefix_caching=True)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP_K))
        for out, p in zip(outs, prompts):
            check_prompt_logprobs(out.prompt_logprobs, p, teacher_forced(hybrid_reference, p), TOP_K)
            assert out.num_cached_tokens == 0
    plain = llm.generate({"prompt_token_ids": prompts[-1]}, SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert plain.num_cached_tokens > 0
