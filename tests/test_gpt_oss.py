"""gpt-oss: HF float32 parity on a tiny checkpoint (4 layers alternating a 16-token sliding
window and full attention, sinks, biased router and experts, clamped SwiGLU, YaRN), 8 prompts
under and over the window decoded together for 48 tokens with 4-token blocks; chunked
prefill with chunks not aligned to the window, under preemption; paging at a 25% budget bit
for bit; config errors."""

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
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("gpt_oss")), "gpt_oss", seed=3)


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


def test_parity_batch(gpt_oss_dir: str, reference: _Reference) -> None:
    """8 prompts of 1..40 tokens (under and over the window) decoded together for 48 tokens."""
    prompts = parity_prompts()
    llm = LLM(gpt_oss_dir, dtype="float32", block_size=BLOCK, max_model_len=128)
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
