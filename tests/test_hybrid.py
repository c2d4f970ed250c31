"""Hybrid models (Qwen3-Next, Qwen3.5-MoE, Granite-4.0-H, Nemotron-H, Kimi-Linear): parity with HF float32 for 8 prompts decoded
together, with forced state swapping (2 device slots for 8 requests), chunked prefill at
several budgets, paged experts, KV memory only for full-attention layers, and the
multimodal Qwen3.5-MoE checkpoint layout."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from conftest import HYBRID_MODELS, NUM_NEW_TOKENS, HFReference, parity_prompts
from parity import LogitsRecorder, check_all, greedy_params
from tiny_checkpoint import make_tiny_checkpoint

from moestream.models.hf_config import model_config_from_hf
from moestream import LLM, SamplingParams
from moestream.engine.kv_cache import kv_block_bytes


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = NUM_NEW_TOKENS):
    recs = [LogitsRecorder() for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy_params(r, max_tokens) for r in recs])
    return [(o.outputs[0].token_ids, r) for o, r in zip(outs, recs)]


ALL_HYBRIDS = [*HYBRID_MODELS, "qwen3_5_moe"]


@pytest.fixture(params=ALL_HYBRIDS)
def any_hybrid(request: pytest.FixtureRequest, hf_reference_of) -> tuple[str, HFReference]:
    """Every hybrid model (Qwen3.5-MoE too): its directory and HF reference."""
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    return model_dir, hf_reference_of(model_dir)


def test_batch_decoded_together(any_hybrid: tuple[str, HFReference]) -> None:
    hybrid_dir, hybrid_reference = any_hybrid
    prompts = parity_prompts()
    llm = LLM(hybrid_dir, dtype="float32", max_model_len=128)
    check_all(prompts, _generate(llm, prompts), hybrid_reference, "hybrid batch")
    pool = llm.llm_engine.state_pool
    assert pool.num_resident() == 0 and pool.num_swapped() == 0 and pool.num_free_slots == pool.max_resident


def test_forced_state_swapping(any_hybrid: tuple[str, HFReference]) -> None:
    """2 device state slots for 8 running requests: each step runs 2 of them (the scheduler
    picks the least recently run), so once all 8 have started every step swaps 2 states in."""
    hybrid_dir, hybrid_reference = any_hybrid
    prompts = parity_prompts()
    llm = LLM(hybrid_dir, dtype="float32", max_model_len=128, max_resident_states=2)
    engine = llm.llm_engine
    recs = [LogitsRecorder() for _ in prompts]
    for i, (p, r) in enumerate(zip(prompts, recs)):
        engine.add_request({"prompt_token_ids": p}, greedy_params(r, NUM_NEW_TOKENS), request_id=str(i))
    pool = engine.state_pool
    final, steps, swaps_per_step = {}, 0, []
    while engine.has_unfinished_requests():
        before = pool.num_swap_ins
        for out in engine.step():
            if out.finished:
                final[int(out.request_id)] = out.outputs[0].token_ids
        assert pool.num_resident() <= 2
        swaps_per_step.append(pool.num_swap_ins - before)
        steps += 1
    # Steps 1-4 start the 8 requests (fresh states, nothing to swap in); after that, while all
    # 8 decode, every step swaps in the states of the 2 it runs.
    assert swaps_per_step[:4] == [0, 0, 0, 0], swaps_per_step
    assert set(swaps_per_step[4:4 * (NUM_NEW_TOKENS - 2)]) == {2}, swaps_per_step
    check_all(prompts, [(final[i], recs[i]) for i in range(8)], hybrid_reference, "swapping")
    assert pool.num_resident() == 0 and pool.num_swapped() == 0 and pool.num_free_slots == 2


@pytest.mark.parametrize(("model", "budget"), [("qwen3_next", 1), ("qwen3_next", 7), ("qwen3_next", 64),
                                               ("nemotron_h", 1), ("nemotron_h", 7), ("kimi_linear", 7)])
def test_chunked_prefill_equals_single_shot(request: pytest.FixtureRequest, model: str, budget: int) -> None:
    """Token budgets that do not divide the prompts (and, for Mamba-2, cross its SSD chunk of 16)."""
    model_dir = request.getfixturevalue(f"{model}_dir")
    prompts = parity_prompts()
    single = _generate(LLM(model_dir, dtype="float32", max_model_len=128), prompts, 8)
    llm = LLM(model_dir, dtype="float32", max_model_len=128, max_num_batched_tokens=budget, max_num_seqs=8)
    chunked = _generate(llm, prompts, 8)
    for (tok_a, rec_a), (tok_b, rec_b), p in zip(single, chunked, prompts):
        assert tok_a == tok_b, f"budget {budget}, prompt len {len(p)}: {tok_b} != single-shot {tok_a}"
        for la, lb in zip(rec_a.logits, rec_b.logits):
            assert (la - lb).abs().max().item() < 1e-4


def test_kv_cache_only_for_full_attention_layers(qwen3_next_dir: str) -> None:
    mc = model_config_from_hf(qwen3_next_dir)
    assert mc.linear_layers == [0, 1, 2] and mc.attention_layers == [3]
    llm = LLM(qwen3_next_dir, dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 20)
    runner = llm.llm_engine.runner
    assert len(runner.kv_caches) == 1
    one_layer = kv_block_bytes(1, 16, mc.num_kv_heads, mc.head_dim, torch.float32)
    num_blocks = llm.llm_engine.kv_cache.num_blocks
    assert num_blocks == (1 << 20) // one_layer  # the budget buys blocks of one layer, not four
    assert runner.kv_cache_bytes == num_blocks * one_layer  # 0 bytes for the 3 linear layers
    pool = llm.llm_engine.state_pool
    # conv [2*2*16 + 4*16 = 128, 3] float32 + recurrent [4, 16, 16] float32, 3 layers, one copy
    assert pool.bytes_per_request == 3 * (128 * 3 * 4 + 4 * 16 * 16 * 4)


@pytest.mark.parametrize("model", ["qwen3_5_moe", "nemotron_h"])
def test_paged_experts_bit_exact(request: pytest.FixtureRequest, model: str) -> None:
    """A quarter of the experts, and the minimum budget (top_k experts' bytes: Nemotron-H's
    ungated experts are (I + I) x H, not 3 x I x H)."""
    model_dir = request.getfixturevalue(f"{model}_dir")
    cfg = model_config_from_hf(model_dir)
    prompts = parity_prompts()[:4]
    # Same state-slot grouping in both runs, so both forwards see the same batch shapes.
    resident = _generate(LLM(model_dir, dtype="float32", max_model_len=128, max_resident_states=3), prompts, 12)
    for budget in (0.25, cfg.num_experts_per_tok * cfg.expert_numel * 4):
        llm = LLM(model_dir, dtype="float32", max_model_len=128, expert_budget=budget, max_resident_states=3)
        paged = _generate(llm, prompts, 12)
        stats = llm.expert_stats()
        assert stats["misses"] > 0 and stats["resident"] is False
        if budget > 1:
            assert llm.llm_engine.expert_store.num_slots == cfg.num_experts_per_tok
        for (ta, ra), (tb, rb) in zip(resident, paged):
            assert ta == tb
            assert all(torch.equal(a, b) for a, b in zip(ra.logits, rb.logits))


def test_multimodal_checkpoint_loads_language_model(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """Qwen3_5MoeForConditionalGeneration: decoder under model.language_model., the vision tower
    loaded (model.visual.); a text prompt takes the text path and matches HF."""
    from transformers import AutoModelForImageTextToText

    d = make_tiny_checkpoint(str(tmp_path / "vl"), "qwen3_5_moe_vl", seed=4)
    with caplog.at_level(logging.INFO, logger="moestream"):
        llm = LLM(d, dtype="float32", max_model_len=64)
    assert any(r.getMessage().startswith("vision tower: 2 blocks") for r in caplog.records)
    prompt = [11, 523, 77, 9000, 42]
    ours = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=10))[0]
    hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert ours.outputs[0].token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("model", ["qwen3_next", "qwen3_5_moe"])
def test_cli_generate_with_two_resident_states(model: str, request: pytest.FixtureRequest, capsys) -> None:
    from moestream.server.cli import main

    d = request.getfixturevalue(f"{model}_dir")
    prompts = ["Hello", "def f(x):", "import os"]
    rc = main(["generate", "--model", d, "--dtype", "float32", "--max-tokens", "6", "--max-model-len", "64",
               "--max-resident-states", "2", *prompts])
    out = capsys.readouterr().out
    assert rc == 0
    offline = LLM(d, dtype="float32", max_model_len=64).generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    for p, o in zip(prompts, offline):
        assert f"--- prompt: {p!r}\n{p}{o.outputs[0].text}\n" in out
    assert main(["generate", "--model", d, "--max-resident-states", "0", "Hi"]) == 2
    assert "max_resident_states must be a positive integer" in capsys.readouterr().err


def test_a_failed_step_recomputes_part_updated_states(qwen3_next_dir: str) -> None:
    """A forward that raises after some linear layers updated their states must not leave
    those states advanced: the engine recomputes the step's requests, output unchanged."""
    prompts = parity_prompts()[:4]
    params = SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in LLM(qwen3_next_dir, dtype="float32", max_model_len=64).generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    llm = LLM(qwen3_next_dir, dtype="float32", max_model_len=64)
    engine = llm.llm_engine
    calls = {"n": 0}

    def fail_once(module, args, output):  # layer 2 (GDN) runs after layers 0 and 1 updated their states
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected failure")

    handle = engine.runner.model.model.layers[2].register_forward_hook(fail_once)
    for i, p in enumerate(prompts):
        engine.add_request({"prompt_token_ids": p}, params, request_id=str(i))
    final, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RuntimeError as e:
            assert "injected" in str(e)
            failures += 1
            continue
        for out in outs:
            if out.finished:
                final[int(out.request_id)] = out.outputs[0].token_ids
    handle.remove()
    assert failures == 1
    assert [final[i] for i in range(4)] == want


@pytest.mark.parametrize(("option", "message"), [
    (dict(moe_runner_backend="fused_cpu"), "moe_runner_backend fused_cpu does not run relu2 experts (nemotron_h) yet"),
    (dict(enable_elastic_memory=True), "enable_elastic_memory does not support ungated experts (nemotron_h) yet"),
])
def test_nemotron_h_refuses_what_ungated_experts_lack(nemotron_h_dir: str, option: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(nemotron_h_dir, dtype="float32", max_model_len=64, **option)


def test_kimi_linear_hub_checkpoint_names_load(kimi_linear_dir: str, tmp_path) -> None:
    """The hub's Kimi-Linear files keep the dense MLP under `mlp.` (transformers 5 writes
    `block_sparse_moe.`): both give the same output."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(kimi_linear_dir, "model.safetensors"))
    renamed = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in tensors.items()}
    assert sum(".mlp." in k for k in renamed) == 3
    for f in os.listdir(kimi_linear_dir):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(kimi_linear_dir, f), tmp_path / f)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    prompts, params = [{"prompt_token_ids": p} for p in parity_prompts()[:2]], SamplingParams(temperature=0, max_tokens=6)
    want = [o.outputs[0].token_ids for o in LLM(kimi_linear_dir, dtype="float32", max_model_len=64).generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in LLM(str(tmp_path), dtype="float32", max_model_len=64).generate(prompts, params)]
    assert got == want and len(want[0]) == 6
