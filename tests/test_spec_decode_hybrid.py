"""Speculative decoding on hybrid models (Qwen3-Next, Qwen3.5-MoE): the verify forward keeps
the Gated DeltaNet state after each of its positions, and the slot takes the one after the
last accepted position. Greedy output is token-exact with speculation off and with HF
float32 (n-gram drafts, and scripted drafts that are accepted and rejected in known
patterns) under state swaps, a 25% expert budget and prefix hits; after every step the
request's state equals a run's that never drafted; blocks of rejected drafts go back."""

from __future__ import annotations

import pytest
import torch
from conftest import HFReference
from parity import check_all
from scripted_proposer import ScriptedProposer
from test_spec_decode import NEW, _generate, _prompts

from moestream import LLM, SamplingParams


def _spec(k: int, **kw) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3, **kw}


@pytest.mark.parametrize("k", [1, 5])
def test_ngram_greedy_equals_off_and_hf(hybrid_dir: str, hybrid_reference: HFReference, k: int) -> None:
    prompts = _prompts()
    llm = LLM(hybrid_dir, dtype="float32", max_model_len=256, speculative_config=_spec(k))
    spec = _generate(llm, prompts)
    off = _generate(LLM(hybrid_dir, dtype="float32", max_model_len=256), prompts)
    assert [t for t, _ in spec] == [t for t, _ in off]
    check_all(prompts, spec, hybrid_reference, f"hybrid ngram k={k}")
    kv = llm.llm_engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and llm.llm_engine.state_pool.num_resident() == 0


@pytest.mark.parametrize("k", [3])  # drafts right for 0..3 positions (one draft: ngram k=1 above)
def test_scripted_drafts_exact_under_swaps_budget_and_prefix_hits(hybrid_dir: str, hybrid_reference: HFReference,
                                                                  k: int) -> None:
    """12 requests whose drafts are right for 0..k positions in turn (so every acceptance
    length occurs), 2 state slots (turn-taking swaps), a 25% expert budget, and a second
    round that hits the prefix cache: the output equals speculation off and HF's."""
    prompts = _prompts()
    off = _generate(LLM(hybrid_dir, dtype="float32", max_model_len=256), prompts)
    llm = LLM(hybrid_dir, dtype="float32", max_model_len=256, max_resident_states=2, expert_budget=0.25,
              speculative_config=_spec(k, adaptive=False))
    engine = llm.llm_engine
    drafter = ScriptedProposer([(p, t) for p, (t, _) in zip(prompts, off)], lambda i, n: (i + n) % (k + 1),
                               engine.model_config.vocab_size)
    engine.proposer = drafter  # this engine's drafts come from the test
    for rnd in range(2):
        spec = _generate(llm, prompts)
        assert [t for t, _ in spec] == [t for t, _ in off], f"round {rnd}"
    check_all(prompts, spec, hybrid_reference, f"hybrid scripted k={k}")
    stats = llm.spec_decode_stats()
    want = [drafter.expected(i, NEW, k) for i in range(len(prompts))]
    assert (stats["num_drafts"], stats["num_accepted_tokens"]) == (2 * sum(d for d, _ in want),
                                                                   2 * sum(a for _, a in want))
    assert engine.state_pool.num_swap_outs > 0 and llm.expert_stats()["misses"] > 0
    assert llm.prefix_cache_stats()["hits"] > 0
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and engine.state_pool.num_resident() == 0


def _states(engine, rid: str) -> list[torch.Tensor]:
    pool = engine.state_pool
    slot = pool.slot_of(rid)
    return [t[slot].clone() for pair in pool.caches() for t in pair]


@pytest.mark.parametrize("right", [1, 3])
def test_state_after_each_step_equals_a_run_that_never_drafted(hybrid_dir: str, right: int) -> None:
    """Drafts right for `right` of 3 positions, then wrong: after every step the slot holds
    the conv and recurrent states a no-draft run holds after the same tokens, and the
    request holds blocks for its tokens only (those of rejected drafts went back)."""
    k, max_tokens = 3, 20
    prompt = _prompts()[3]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain = LLM(hybrid_dir, dtype="float32", max_model_len=128)
    rid = plain.llm_engine.add_request({"prompt_token_ids": prompt}, params)
    want: dict[int, list[torch.Tensor]] = {}
    ref: list[int] = []
    while plain.llm_engine.has_unfinished_requests():
        (out,) = plain.llm_engine.step()
        ref = out.outputs[0].token_ids
        if not out.finished:
            want[plain.llm_engine.requests[rid].num_computed_tokens] = _states(plain.llm_engine, rid)
    llm = LLM(hybrid_dir, dtype="float32", max_model_len=128, speculative_config=_spec(k, adaptive=False))
    engine = llm.llm_engine
    engine.proposer = ScriptedProposer([(prompt, ref)], lambda i, n: right, engine.model_config.vocab_size)
    rid = engine.add_request({"prompt_token_ids": prompt}, params)
    checked = 0
    while engine.has_unfinished_requests():
        (out,) = engine.step()
        if out.finished:
            break
        req = engine.requests[rid]
        for got, exp in zip(_states(engine, rid), want[req.num_computed_tokens]):
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)
        kv = engine.kv_cache  # blocks for computed tokens and the next one, none for rejected drafts
        assert kv.blocks_needed(req.num_computed_tokens) <= len(kv.block_table(rid)) <= kv.blocks_needed(req.num_tokens)
        checked += 1
    assert out.outputs[0].token_ids == ref
    assert checked == (max_tokens - 1 - engine.spec_decode_stats()["num_accepted_tokens"])


def test_checkpoints_hold_only_verified_tokens(qwen3_next_dir: str) -> None:
    """Decode checkpoints (prefix caching) are captured where verified tokens cross a block
    boundary, also inside accepted drafts, and never at a rejected draft: a follow-up that
    re-sends prompt + output hits exactly as many tokens as after a run without drafts, and
    its output equals a cold run's."""
    prompt = _prompts()[5]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    follow_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cold = LLM(qwen3_next_dir, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    ref = cold.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    follow = prompt + ref + [7, 8, 9]
    want = cold.generate([{"prompt_token_ids": follow}], follow_params)[0].outputs[0].token_ids
    hits = []
    for k, right in ((0, None), (3, lambda i, n: n % 4), (5, lambda i, n: 5)):  # 5 of 5 right: 6 tokens a step
        llm = LLM(qwen3_next_dir, dtype="float32", max_model_len=256, speculative_config=_spec(k) if k else None)
        engine = llm.llm_engine
        if k:
            engine.proposer = ScriptedProposer([(prompt, ref)], right, engine.model_config.vocab_size)
        assert llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids == ref
        assert llm.generate([{"prompt_token_ids": follow}], follow_params)[0].outputs[0].token_ids == want
        hits.append(llm.prefix_cache_stats()["hits"])
        if k:
            assert llm.spec_decode_stats()["num_accepted_tokens"] > 0
    # The output checkpoint sits at the last block boundary of the computed tokens.
    assert hits == [(len(prompt) + len(ref) - 1) // 16 * 16] * 3
