"""Quantized checkpoints (FP8 block-wise, compressed-tensors int4 / int8 / FP8, GPTQ with and
without desc_act, MXFP4): greedy tokens and logits equal HF float32 on the exact
dequantization (`bench/quantize_checkpoint.py`), resident and paged bit for bit at 25% and the minimum
budget, each miss reading the expert's stored bytes; refusals at start-up; no slot or
block left behind after aborts and preemption."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import HFReference, count_calls, parity_prompts
from moestream import LLM, SamplingParams
from moestream.config.quantization import QuantizationConfig
from moestream.experts.interface import PACKED_ALIGN
from moestream.experts.tiers import read_safetensors_header
from moestream.quantization.registry import make_quant_method
from parity import LogitsRecorder, check_all, greedy_params
from tiny_checkpoint import make_tiny_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from quantize_checkpoint import FORMATS, quantize_checkpoint  # noqa: E402

NUM_TOKENS = 32
CASES = [("qwen3_moe", f) for f in FORMATS] + [
    ("deepseek_v3", f) for f in ("fp8-block", "ct-int4-asym", "gptq-desc-act", "mxfp4")]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory):
    """(model type, format) -> (quantized dir, float32 oracle dir), built once per module and
    removed after it (about 2 GB in all: CI machines' disks can be small)."""
    built: dict[tuple[str, str], tuple[str, str]] = {}
    floats: dict[str, str] = {}
    roots: list[str] = []

    def get(model: str, fmt: str) -> tuple[str, str]:
        if model not in floats:
            roots.append(str(tmp_path_factory.mktemp(model)))
            floats[model] = make_tiny_checkpoint(roots[-1], model)
        if (model, fmt) not in built:
            root = tmp_path_factory.mktemp(f"{model}-{fmt}")
            roots.append(str(root))
            q, oracle = str(root / "quantized"), str(root / "oracle")
            quantize_checkpoint(floats[model], q, oracle, fmt)
            built[(model, fmt)] = (q, oracle)
        return built[(model, fmt)]

    yield get
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], LogitsRecorder]]:
    recs = [LogitsRecorder() for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy_params(r, NUM_TOKENS) for r in recs])
    return [(o.outputs[0].token_ids, r) for o, r in zip(outs, recs)]


def _stored_expert_bytes(model_dir: str, layer: int, num_experts: int) -> tuple[int, int]:
    """(bytes the checkpoint stores for one expert of `layer`, the same with each tensor
    padded to PACKED_ALIGN), from the safetensors header: per-expert tensors
    `...experts.0.*`, or 1/E of the fused `...experts.*_proj_*` ones."""
    header = read_safetensors_header(os.path.join(model_dir, "model.safetensors"))
    prefix = f"model.layers.{layer}.mlp.experts."
    per = [loc.nbytes for name, loc in header.items() if name.startswith(prefix + "0.")]
    if not per:
        per = [loc.nbytes // num_experts for name, loc in header.items() if name.startswith(prefix)]
    return sum(per), sum(math.ceil(n / PACKED_ALIGN) * PACKED_ALIGN for n in per)


@pytest.mark.parametrize("model, fmt", CASES)
def test_parity_and_paging(model: str, fmt: str, quantized) -> None:
    qdir, oracle = quantized(model, fmt)
    prompts = parity_prompts()
    resident_llm = LLM(qdir, dtype="float32")
    resident = _run(resident_llm, prompts)
    check_all(prompts, resident, HFReference(oracle), f"{model} {fmt}")
    cfg = resident_llm.llm_engine.model_config
    layer = cfg.moe_layers.index(True)
    stored, padded = _stored_expert_bytes(qdir, layer, cfg.num_experts)
    plan = resident_llm.llm_engine.expert_plan
    bf16 = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 2
    assert plan.expert_bytes == padded < bf16  # the planner counts the packed bytes
    minimum = cfg.num_experts_per_tok * plan.expert_bytes
    for budget in (0.25, minimum):  # the resident run's batch: logits are compared bit for bit
        llm = LLM(qdir, dtype="float32", expert_budget=budget)
        paged = _run(llm, prompts)
        for (tokens, rec), (want, want_rec) in zip(paged, resident):
            assert tokens == want
            assert all(torch.equal(a, b) for a, b in zip(rec.logits, want_rec.logits))
        st = llm.expert_stats()
        assert st["misses"] > 0 and st["expert_bytes"] == padded
        # no host cache: every miss is one read of the expert's stored tensors from disk
        assert st["bytes_read_per_tier"] == {"disk": st["misses"] * stored, "host": 0}
        assert st["num_slots"] == (2 if budget == minimum else int(0.25 * plan.total_bytes) // padded)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int_experts_run_in_the_fused_kernel(quantized, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """compressed-tensors int4 (asymmetric, gate and up apart): decode steps run the fused
    kernel on the packed integers in place (`fused_moe_int`), resident and paged alike, bit
    for bit; in float32 the tokens and logits still match HF on the exact dequantization."""
    import moestream.layers.expert_executor as executor

    calls = count_calls(monkeypatch, executor, "fused_moe_int")
    qdir, oracle = quantized("deepseek_v3", "ct-int4-asym")
    prompts = parity_prompts()[:4]
    resident = _run(LLM(qdir, dtype=dtype), prompts)
    used = calls[0]
    paged = _run(LLM(qdir, dtype=dtype, expert_budget=0.25, expert_direct_io="on"), prompts)  # packed bytes, O_DIRECT
    assert used > 0 and calls[0] > used
    for (tokens, rec), (want, want_rec) in zip(paged, resident):
        assert tokens == want
        assert all(torch.equal(a, b) for a, b in zip(rec.logits, want_rec.logits))
    if dtype == "float32":
        check_all(prompts, resident, HFReference(oracle), f"deepseek_v3 ct-int4-asym {dtype}")


def test_host_cache_holds_packed_experts(quantized) -> None:
    """With a host cache, a miss found there is read where it lies (CPU), counted at the
    packed size; output as resident."""
    qdir, _ = quantized("qwen3_moe", "ct-int4")
    prompts = parity_prompts()[:4]
    want = _run(LLM(qdir, dtype="float32"), prompts)
    llm = LLM(qdir, dtype="float32", expert_budget=0.25, expert_host_cache_bytes=1 << 20)
    got = _run(llm, prompts)
    assert [t for t, _ in got] == [t for t, _ in want]
    st = llm.expert_stats()
    stored, _ = _stored_expert_bytes(qdir, 0, 8)
    assert st["host_computed"] > 0 and st["host_cache_experts"] == 16
    assert st["bytes_read_per_tier"]["disk"] == 16 * stored  # each expert read from disk once


def test_no_leaks_after_abort_and_preemption(quantized) -> None:
    qdir, _ = quantized("qwen3_moe", "gptq")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 30000) for _ in range(n)] for n in (30, 5, 60, 17, 44, 9)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(qdir, dtype="float32", max_model_len=128)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    llm = LLM(qdir, dtype="float32", max_model_len=128, expert_budget=0.25,
              kv_cache_memory_bytes=10 * plain.llm_engine.kv_cache_block_bytes)
    engine = llm.llm_engine
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    for _ in range(6):
        engine.step()
    for rid in ids[1::2]:
        engine.abort_request(rid)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[rid] for rid in ids[0::2]] == want[0::2]
    assert engine.scheduler.num_preemptions > 0
    kv, st = engine.kv_cache, llm.expert_stats()
    assert kv.num_free_blocks == kv.num_blocks
    assert st["free_slots"] + st["resident_experts"] == st["num_slots"] and st["loading_experts"] == 0


def _edit(src: str, dst: str, config: dict | None = None, drop: str | None = None) -> str:
    """A copy of checkpoint `src` at `dst` with `config` merged into its quantization_config and
    tensor `drop` removed; an unedited weights file is linked, not copied (22 copies of 172 MB
    filled a CI machine's disk)."""
    weights = os.path.join(src, "model.safetensors")
    shutil.copytree(src, dst, ignore=None if drop is not None else shutil.ignore_patterns("model.safetensors"))
    if drop is None:
        os.symlink(weights, os.path.join(dst, "model.safetensors"))
    if config is not None:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = {**cfg["quantization_config"], **config}
        with open(path, "w") as f:
            json.dump(cfg, f)
    if drop is not None:
        path = os.path.join(dst, "model.safetensors")
        tensors = load_file(path)
        del tensors[drop]
        save_file(tensors, path)
    return dst


@pytest.mark.parametrize("fmt, config, drop, message", [
    ("gptq", dict(quant_method="awq"), None, "quant_method 'awq' is not supported; moestream reads fp8, "
     "compressed-tensors, gptq, mxfp4"),
    ("gptq", dict(bits=3), None, "bits 3 is not supported; GPTQ checkpoints must have 4 or 8 bits"),
    ("gptq", dict(group_size=0), None, "group_size 0 is not supported"),
    ("gptq", dict(group_size=32), None, "has shape [4, 4]; its gptq int4 group 32 weight needs [2, 4]"),  # made with 16
    ("ct-int4", dict(format="marlin-24"), None, "format 'marlin-24' is not supported"),
    ("ct-int4", dict(config_groups={"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 2, "type": "int", "symmetric": True, "strategy": "group", "group_size": 8}}}), None,
     "num_bits 2 is not supported"),
    ("fp8-block", dict(weight_block_size=[64, 64]), None, "has shape [1, 2]; its fp8 block 64x64 weight needs [1, 1]"),
    ("fp8-block", dict(weight_block_size=[0, 128]), None, "weight_block_size must be two positive ints"),
    ("fp8-block", None, "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv",
     "no tensor 'model.layers.2.mlp.experts.5.down_proj.weight_scale_inv', which its fp8 block 32x32 weight needs"),
    ("fp8-block", None, "model.layers.1.self_attn.q_proj.weight_scale_inv",
     "no tensor 'model.layers.1.self_attn.q_proj.weight_scale_inv', which its fp8 block 32x32 weight needs"),
    ("mxfp4", None, "model.layers.0.mlp.experts.down_proj_scales", "no tensor 'model.layers.0.mlp.experts.down_proj_scales'"),
])
@pytest.mark.parametrize("budget", [None, 0.25])
def test_refused_at_start_up(fmt: str, config: dict | None, drop: str | None, message: str, budget: float | None,
                             quantized, tmp_path) -> None:
    d = _edit(quantized("qwen3_moe", fmt)[0], str(tmp_path / "ckpt"), config, drop)
    with pytest.raises(ValueError) as e:
        LLM(d, dtype="float32", expert_budget=budget)
    assert message in str(e.value)


def test_fp8_refused_without_float8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match="cannot read float8_e4m3fn weights"):
        make_quant_method(QuantizationConfig("fp8", weight_block_size=(128, 128)))


def test_elastic_memory_refused(quantized) -> None:
    with pytest.raises(ValueError, match="does not hold quantized"):
        LLM(quantized("qwen3_moe", "mxfp4")[0], dtype="float32", expert_budget=0.5, enable_elastic_memory=True)


def test_hybrid_fp8_with_mtp(qwen3_next_dir: str, tmp_path) -> None:
    """Qwen3-Next in FP8 (its Gated DeltaNet projections and MTP layer quantized too): HF
    parity on the dequantized oracle, and MTP speculation gives the same tokens as without."""
    from test_spec_decode_mtp import SPEC, add_mtp_weights

    src = add_mtp_weights(qwen3_next_dir, str(tmp_path / "float"))
    q, oracle = str(tmp_path / "fp8"), str(tmp_path / "oracle")
    quantize_checkpoint(src, q, oracle, "fp8-block")
    assert "mtp.layers.0.self_attn.q_proj.weight_scale_inv" in load_file(os.path.join(q, "mtp.safetensors"))
    prompts = parity_prompts()[:4]
    plain = _run(LLM(q, dtype="float32", max_model_len=256), prompts)
    check_all(prompts, plain, HFReference(oracle), "qwen3_next fp8-block")
    spec = LLM(q, dtype="float32", max_model_len=256, speculative_config=SPEC)
    assert [t for t, _ in _run(spec, prompts)] == [t for t, _ in plain]
    assert spec.spec_decode_stats()["num_drafts"] > 0
