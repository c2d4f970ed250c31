"""gpt-oss: HF float32 parity on a tiny checkpoint (4 layers alternating a 16-token sliding
window and full attention, sinks, biased router and experts, clamped SwiGLU, YaRN), 8 prompts
under and over the window decoded together for 48 tokens with 4-token blocks; chunked
prefill with chunks not aligned to the window, under preemption; paging at a 25% budget bit
for bit; MXFP4 experts; config errors. KV cache groups: the sliding group's blocks behind
the window go back to the pool (exact count per step), nothing leaks after abort, prefix
hits over both groups (exact token count, output as with caching off), n-gram speculation
exact with a window shorter than a draft's reach."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from conftest import HFReference, parity_prompts
from parity import LogitsRecorder, check_all, greedy_params
from tiny_checkpoint import make_tiny_checkpoint

from moestream import LLM
from moestream.models.hf_config import model_config_from_dict, model_config_from_hf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

NEW_TOKENS = 48
WINDOW = 16
BLOCK = 4


class _Reference:
    """HF's greedy tokens and logits for NEW_TOKENS tokens (`check_all`'s reference)."""

    def __init__(self, model_dir: str) -> None:
        self.hf = HFReference(model_dir)

    def generate(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        return self.hf.generate(prompt, NEW_TOKENS)


@pytest.fixture(scope="module")
def reference(gpt_oss_dir: str) -> _Reference:
    return _Reference(gpt_oss_dir)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], LogitsRecorder]]:
    recs = [LogitsRecorder() for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy_params(r, NEW_TOKENS) for r in recs])
    return [(o.outputs[0].token_ids, r) for o, r in zip(outs, recs)]


def test_config(gpt_oss_dir: str) -> None:
    cfg = model_config_from_hf(gpt_oss_dir)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert [cfg.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert cfg.attention_layers == [0, 1, 2, 3] and cfg.attention_sinks and cfg.router.bias
    act = cfg.expert_activation
    assert (act.name, act.alpha, act.limit, act.bias) == ("swigluoai", 1.702, 1.0, True)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.get("truncate") is False


@pytest.mark.parametrize("block_size", [BLOCK, 3])
def test_parity_batch(gpt_oss_dir: str, reference: _Reference, block_size: int) -> None:
    """8 prompts of 1..40 tokens (under and over the window) decoded together for 48 tokens.

    Block size 3 divides neither the window nor the default state_checkpoint_interval
    (512), which only a model with linear-attention layers needs (regression: it was
    refused for every model)."""
    prompts = parity_prompts()
    llm = LLM(gpt_oss_dir, dtype="float32", block_size=block_size, max_model_len=128)
    report = check_all(prompts, _generate(llm, prompts), reference, "gpt-oss batch")
    assert report.max_logit_diff < 1e-4


def test_parity_chunked_prefill_under_preemption(gpt_oss_dir: str, reference: _Reference) -> None:
    """Chunks of 7 tokens (not a divisor of the 16-token window) and a KV pool of 30 4-token
    blocks, so that requests are preempted and recomputed."""
    prompts = parity_prompts()
    cfg = model_config_from_hf(gpt_oss_dir)
    block_bytes = len(cfg.attention_layers) * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * BLOCK
    llm = LLM(gpt_oss_dir, dtype="float32", block_size=BLOCK, max_model_len=96, max_num_batched_tokens=7,
              kv_cache_memory_bytes=30 * block_bytes)
    engine = llm.llm_engine
    results = _generate(llm, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    check_all(prompts, results, reference, "gpt-oss chunked + preemption")


def test_paging_bit_exact(gpt_oss_dir: str) -> None:
    """At a 25% expert budget, tokens and logits equal the resident run bit for bit."""
    prompts = parity_prompts()[3:]

    def run(**kw) -> tuple[list[list[int]], list[list[torch.Tensor]], LLM]:
        llm = LLM(gpt_oss_dir, dtype="float32", block_size=BLOCK, max_model_len=96, **kw)
        results = _generate(llm, prompts)
        return [t for t, _ in results], [r.logits for _, r in results], llm

    tokens, logits, llm = run()
    assert llm.expert_stats()["resident"] is True
    t, lg, llm = run(expert_budget=0.25)
    stats = llm.expert_stats()
    assert stats["resident"] is False and stats["misses"] > 0
    assert t == tokens
    assert all(torch.equal(a, b) for x, y in zip(lg, logits) for a, b in zip(x, y))


@pytest.mark.parametrize(("change", "field"), [
    (dict(layer_types=["sliding_attention", "linear_attention", "full_attention", "full_attention"]), "layer_types"),
    (dict(layer_types=["sliding_attention"]), "layer_types"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(swiglu_limit=0), "swiglu_limit"),
])
def test_config_errors_name_the_field(gpt_oss_dir: str, change: dict, field: str) -> None:
    with open(os.path.join(gpt_oss_dir, "config.json")) as f:
        hf = json.load(f)
    hf.update(change)
    with pytest.raises(ValueError, match=field):
        model_config_from_dict(hf)


def test_bf16_checkpoint_runs(gpt_oss_dir: str, tmp_path) -> None:
    """A bf16 checkpoint (as the hub's bf16 gpt-oss) loads, and greedy bf16 decoding matches
    the float32 engine's first tokens on a short prompt (the tiny model's top-2 gaps are wide
    at its start)."""
    from safetensors.torch import load_file, save_file

    d = str(tmp_path / "bf16")
    shutil.copytree(gpt_oss_dir, d)
    path = os.path.join(d, "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    prompt = parity_prompts()[4]
    ours = LLM(d, dtype="bfloat16", block_size=BLOCK, max_model_len=96)
    out = _generate(ours, [prompt])[0][0]
    ref = _generate(LLM(d, dtype="float32", block_size=BLOCK, max_model_len=96), [prompt])[0][0]
    assert len(out) == NEW_TOKENS and out[:4] == ref[:4]


def test_mxfp4_experts_match_their_dequantized_oracle(gpt_oss_dir: str, tmp_path) -> None:
    """MXFP4 experts (gpt-oss's `*_blocks` / `*_scales`, gate and up rows interleaved) against HF
    float32 on the exact dequantization; paged at 25% bit for bit with resident; each miss reads
    the expert's packed bytes only."""
    from quantize_checkpoint import quantize_checkpoint  # bench/

    q, oracle = str(tmp_path / "mxfp4"), str(tmp_path / "oracle")
    quantize_checkpoint(gpt_oss_dir, q, oracle, "mxfp4")
    prompts = parity_prompts()
    resident = LLM(q, dtype="float32", block_size=BLOCK, max_model_len=128)
    results = _generate(resident, prompts)
    check_all(prompts, results, _Reference(oracle), "gpt-oss mxfp4")
    paged = LLM(q, dtype="float32", block_size=BLOCK, max_model_len=128, expert_budget=0.25)
    again = _generate(paged, prompts)
    assert [t for t, _ in again] == [t for t, _ in results]
    assert all(torch.equal(a, b) for (_, x), (_, y) in zip(again, results) for a, b in zip(x.logits, y.logits))
    stats = paged.expert_stats()
    cfg = model_config_from_hf(q)
    packed = 2 * cfg.moe_intermediate_size * (cfg.hidden_size // 32) * 17 + cfg.hidden_size * (
        cfg.moe_intermediate_size // 32) * 17  # 16 bytes of nibbles + 1 scale byte per block of 32
    assert stats["misses"] > 0 and stats["bytes_read_per_tier"]["disk"] == stats["misses"] * packed


def _step_until_done(engine, check=None) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if check is not None:
            check()
    return done


def test_sliding_group_blocks_are_bounded_by_the_window(gpt_oss_dir: str) -> None:
    """Decoding to 10x the window: after each decode step the request holds, in the sliding
    group, exactly the blocks from the one of position p - W + 1 to the last one (p: the
    position computed in that step; the blocks were trimmed when it was scheduled), so at
    most ceil((W - 1) / B) + 1 = 5; the full group holds ceil((p + 1) / B); every other
    block is free."""
    from moestream import SamplingParams
    from moestream.engine.kv_cache import NULL_BLOCK

    llm = LLM(gpt_oss_dir, dtype="float32", block_size=BLOCK, max_model_len=256)
    engine, coord = llm.llm_engine, llm.llm_engine.coordinator
    full, sliding = coord.groups
    assert (full.window, sliding.window) == (None, WINDOW)
    engine.add_request({"prompt_token_ids": parity_prompts()[5]}, SamplingParams(temperature=0, max_tokens=10 * WINDOW,
                                                                              ignore_eos=True), request_id="long")
    bound = -(-(WINDOW - 1) // BLOCK) + 1
    seen: list[int] = []
    computed = [0]  # num_computed_tokens before the step

    def check() -> None:
        req = engine.requests.get("long")
        if req is None:
            return
        p0, nc = computed[0], req.num_computed_tokens
        computed[0] = nc
        table = sliding.block_table("long")
        held = [b for b in table if b != NULL_BLOCK]
        first = max(0, p0 - WINDOW + 1) // BLOCK  # trimmed when the step was scheduled at p0
        assert table[:first] == [NULL_BLOCK] * first and len(table) == -(-nc // BLOCK)
        assert len(held) == len(table) - first
        if nc - p0 == 1:  # a decode step
            assert len(held) <= bound
            seen.append(len(held))
        assert len(full.block_table("long")) == -(-nc // BLOCK)
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks - len(held) - len(full.block_table("long"))

    out = _step_until_done(engine, check)
    assert len(out["long"]) == 10 * WINDOW and max(seen) == bound
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    stats = llm.kv_cache_stats()["groups"]
    assert stats == [{"kind": "full", "window": None, "used_blocks": 0},
                     {"kind": "sliding", "window": WINDOW, "used_blocks": 0}]


def test_abort_frees_both_groups(gpt_oss_dir: str) -> None:
    from moestream import SamplingParams

    llm = LLM(gpt_oss_dir, dtype="float32", block_size=BLOCK, max_model_len=256)
    engine = llm.llm_engine
    for i, p in enumerate(parity_prompts()):
        engine.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                           request_id=f"r{i}")
    for _ in range(30):
        engine.step()
    groups = llm.kv_cache_stats()["groups"]
    assert [g["used_blocks"] > 0 for g in groups] == [True, True]
    assert groups[0]["used_blocks"] + groups[1]["used_blocks"] == engine.kv_cache.num_blocks - engine.kv_cache.num_free_blocks
    from moestream.server.async_engine import take_snapshot
    from moestream.server.metrics import ServerMetrics

    snap = take_snapshot(engine)
    server_metrics = ServerMetrics()
    server_metrics.bind(lambda: snap, lambda: 0)
    metrics = {s.labels["group"]: s.value for m in server_metrics.registry.collect()
               if m.name == "moestream:kv_cache_group_blocks" for s in m.samples}
    assert metrics == {"full": groups[0]["used_blocks"], "sliding": groups[1]["used_blocks"]}
    for i in range(8):
        engine.abort_request(f"r{i}")
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and all(kv.ref_count(b) == 0 for b in range(kv.num_blocks))


def test_prefix_hit_over_both_groups(gpt_oss_dir: str) -> None:
    """A prompt sharing 3 windows (48 tokens, 12 blocks) with an earlier one hits exactly 48
    tokens: the full group's 12 blocks and the sliding group's blocks 8-11 (positions 33-47,
    the window before token 48; blocks 0-7 are not needed). The first prompt runs in
    7-token chunks, so its sliding blocks behind the window were given back while it ran
    (kept in the pool with their hashes). Outputs equal caching off."""
    from moestream import SamplingParams

    shared = parity_prompts()[-1] + parity_prompts()[3][:8]  # 48 tokens
    prompts = [shared + [11, 12, 13, 14, 15], shared + [21, 22, 23]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", block_size=BLOCK, max_model_len=128, max_num_batched_tokens=7)
    cold = LLM(gpt_oss_dir, enable_prefix_caching=False, **kw)
    expected = [cold.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(gpt_oss_dir, enable_prefix_caching=True, **kw)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params)[0]
    assert llm.prefix_cache_stats()["hits"] == 0
    second = llm.generate([{"prompt_token_ids": prompts[1]}], params)[0]
    assert llm.prefix_cache_stats()["hits"] == 48 and second.num_cached_tokens == 48
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == expected


def test_speculation_exact_with_a_short_window(tmp_path) -> None:
    """Drafts of 3 tokens (scripted: right for 0-3 positions, so both accepted and rejected)
    on a gpt-oss whose window (3 tokens) is shorter than a verify step's reach (4
    positions): tokens equal speculation off, the acceptance counts are the script's, and
    every block is back in the pool; plain n-gram drafts stay exact too."""
    from scripted_proposer import ScriptedProposer

    from moestream import SamplingParams

    d = make_tiny_checkpoint(str(tmp_path / "w3"), "gpt_oss", seed=4, sliding_window=3)
    prompts = [[7, 8, 9, 10] * 6, parity_prompts()[6]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(dtype="float32", block_size=BLOCK, max_model_len=128)
    off = [o.outputs[0].token_ids for o in LLM(d, **kw).generate([{"prompt_token_ids": p} for p in prompts], params)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    ngram = LLM(d, speculative_config=spec, **kw)
    assert [o.outputs[0].token_ids for o in ngram.generate([{"prompt_token_ids": p} for p in prompts], params)] == off
    llm = LLM(d, speculative_config=spec, **kw)
    script = ScriptedProposer(list(zip(prompts, off)), lambda i, n: (i + n) % 4, llm.llm_engine.model_config.vocab_size)
    llm.llm_engine.proposer = script
    on = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
    assert on == off
    accepted = sum(script.expected(i, 40, 3)[1] for i in range(len(prompts)))
    assert llm.llm_engine.spec_decode_stats()["num_accepted_tokens"] == accepted > 0
    kv = llm.llm_engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_one_group_when_the_hybrid_manager_is_disabled(gpt_oss_dir: str) -> None:
    """`disable_hybrid_kv_cache_manager` (vLLM's flag): one group holding every block, each
    block twice the layers; the same tokens."""
    from moestream import SamplingParams

    prompts = parity_prompts()[4:]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", block_size=BLOCK, max_model_len=96)
    grouped = LLM(gpt_oss_dir, **kw)
    single = LLM(gpt_oss_dir, disable_hybrid_kv_cache_manager=True, **kw)
    assert [g["kind"] for g in single.kv_cache_stats()["groups"]] == ["full"]
    assert single.kv_cache_stats()["bytes_per_token"] == 2 * grouped.kv_cache_stats()["bytes_per_token"]
    run = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
           for llm in (grouped, single)]
    assert run[0] == run[1]


def test_elastic_memory_refused_with_two_groups(gpt_oss_dir: str) -> None:
    with pytest.raises(ValueError, match="several KV cache groups"):
        LLM(gpt_oss_dir, dtype="float32", expert_budget=0.5, enable_elastic_memory=True)
