"""The compiled decode step (`models/decoder_layer_cpu.py`): a decode-only step's layers in one C++
call each give the Python path's tokens and logits bit for bit, fall back where they do not
cover a layer or a step, and refuse bad input with an error."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import count_calls, parity_prompts
from parity import LogitsRecorder, greedy_params
from tiny_checkpoint import make_tiny_checkpoint

import moestream.models.moe_decoder as decoder_module
from moestream import LLM
from moestream.kernels.build import load_cpu_kernels

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="needs the C++ kernels (a compiler)")


@pytest.fixture(scope="module")
def mixtral_full_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Mixtral without a sliding window: GQA without q/k norms, which the C++ layer covers."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("mixtral_full")), "mixtral", seed=5, sliding_window=None)


def _run(llm: LLM, prompts: list[list[int]], n: int | list[int] = 20) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Greedy tokens and each step's logits per prompt (n tokens each, or n[i] for prompt i)."""
    recs = [LogitsRecorder() for _ in prompts]
    lengths = n if isinstance(n, list) else [n] * len(prompts)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [greedy_params(r, m) for r, m in zip(recs, lengths)])
    return [(o.outputs[0].token_ids, r.logits) for o, r in zip(outs, recs)]


@pytest.fixture
def layer_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times a layer ran through the C++ decode layer."""
    return count_calls(monkeypatch, decoder_module, "run_layer")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["qwen3_moe", "mixtral_full"])
def test_equals_the_python_layers_bit_for_bit(request: pytest.FixtureRequest, model: str, dtype: str,
                                              layer_calls: list[int]) -> None:
    """Qwen3-MoE (q/k norms) and Mixtral (none), 8 prompts in one batch: the decode steps
    take the C++ layer, and tokens, every step's logits and the expert hit count equal
    enforce_eager's (the Python layers)."""
    path = request.getfixturevalue(f"{model}_dir")
    prompts = parity_prompts()
    kw = dict(dtype=dtype, max_model_len=96, block_size=4)
    eager_llm = LLM(path, enforce_eager=True, **kw)
    eager = _run(eager_llm, prompts)
    assert layer_calls[0] == 0
    llm = LLM(path, **kw)
    compiled = _run(llm, prompts)
    layers = sum(p is not None for p in llm.llm_engine.runner.model._plans[getattr(torch, dtype)])
    assert layers >= 2 and layer_calls[0] >= 10 * layers  # 20 tokens: most steps after the prefills are decode-only
    for (t1, l1), (t2, l2) in zip(eager, compiled):
        assert t1 == t2
        assert len(l1) == len(l2) and all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert llm.expert_stats()["hits"] == eager_llm.expert_stats()["hits"] > 0


def test_a_step_past_a_layers_rows_runs_the_python_layer(qwen3_moe_dir: str, layer_calls: list[int]) -> None:
    """Plans holding for at most 2 requests, 4 requests of 4, 8, 14 and 20 tokens: the steps
    of 3 or 4 decodes run the Python layers, the later ones the C++ layers; the output equals
    enforce_eager's."""
    prompts, lengths = parity_prompts()[:4], [4, 8, 14, 20]
    eager = _run(LLM(qwen3_moe_dir, dtype="float32", max_model_len=96, enforce_eager=True), prompts, lengths)
    llm = LLM(qwen3_moe_dir, dtype="float32", max_model_len=96)
    model = llm.llm_engine.runner.model
    _run(llm, prompts[:1], [2])  # a decode step makes the plans
    model._plans[torch.float32] = [p and dataclasses.replace(p, max_rows=2) for p in model._plans[torch.float32]]
    before = layer_calls[0]
    compiled = _run(llm, prompts, lengths)
    for (t1, l1), (t2, l2) in zip(eager, compiled):
        assert t1 == t2 and all(torch.equal(a, b) for a, b in zip(l1, l2))
    layers = sum(p is not None for p in model._plans[torch.float32])  # the covered ones (not dense MLP layers)
    # 12 steps of 2 or 1 decodes (tokens 9-20); the 4 first steps of 3-4 decodes stay in Python
    assert layers * 10 <= layer_calls[0] - before <= layers * 13


@pytest.mark.parametrize("kw", [dict(expert_budget=0.5), dict(batch_invariant=True), dict(gemm_backend="torch"),
                                dict(enforce_eager=True)])
def test_not_covered_keeps_the_python_layers(qwen3_moe_dir: str, kw: dict, layer_calls: list[int]) -> None:
    """Paged experts, batch-invariant mode, PyTorch GEMMs and enforce_eager: no C++ layer."""
    llm = LLM(qwen3_moe_dir, dtype="float32", max_model_len=64, **kw)
    _run(llm, parity_prompts()[:2], 4)
    assert layer_calls[0] == 0


def test_sliding_window_layers_equal_the_python_layers(mixtral_dir: str, layer_calls: list[int]) -> None:
    """Mixtral with a 24-token window, prompts and outputs past it: the C++ layers read from
    context - window on, and every step's logits equal enforce_eager's."""
    prompts = parity_prompts()[-3:]  # the longest: 25, 33 and 40 tokens
    eager = _run(LLM(mixtral_dir, dtype="float32", max_model_len=96, block_size=4, enforce_eager=True), prompts)
    compiled = _run(LLM(mixtral_dir, dtype="float32", max_model_len=96, block_size=4), prompts)
    assert layer_calls[0] > 0
    for (t1, l1), (t2, l2) in zip(eager, compiled):
        assert t1 == t2 and all(torch.equal(a, b) for a, b in zip(l1, l2))


def test_sinks_are_not_covered(gpt_oss_dir: str, layer_calls: list[int]) -> None:
    """gpt-oss (attention sinks, expert biases) keeps the Python layers."""
    _run(LLM(gpt_oss_dir, dtype="float32", max_model_len=64), parity_prompts()[:2], 4)
    assert layer_calls[0] == 0


def test_bad_input_is_refused() -> None:
    cls = torch.classes.moestream_cpu.DecoderLayer
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        cls(4, 3, 16, 0.25, False, 2, True, True, 1.0, 0, 1.0, 0.0, False, 2, 12)
    layer = cls(4, 2, 16, 0.25, False, 2, True, True, 1.0, 0, 1.0, 0.0, False, 2, 12)
    with pytest.raises(RuntimeError, match="which must be 0-4"):
        layer.set_linear(5, torch.zeros(4, 4), torch.empty(0), 3, 4, 0, False)
    with pytest.raises(RuntimeError, match="gate_up \\[E, 2I, H\\]"):
        layer.set_experts(torch.zeros(2, 4), torch.zeros(2, 4, 2), torch.zeros((), dtype=torch.int64))
    cache = torch.zeros(2, 4, 2, 16)
    empty = torch.empty(0)
    with pytest.raises(RuntimeError, match="set_norms and set_experts first"):
        layer.forward(torch.zeros(1, 64), cache, cache, empty, empty, torch.zeros(1, dtype=torch.int64),
                      torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int64),
                      torch.zeros(1, dtype=torch.int64))
