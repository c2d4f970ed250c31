"""Defaults from the model's generation_config.json (vLLM's --generation-config auto), and
the dtype `auto` computes in on CPUs without native bf16."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.engine.llm_engine import auto_compute_dtype
from moestream.generation_config import default_sampling_fields
from moestream.server.protocol import CompletionRequest
from moestream.server.serving import OpenAIServing, ServerConfig


def _write(folder: str, data: object) -> None:
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(data, f)


def test_fields_read_mapped_and_checked(tmp_path) -> None:
    d = str(tmp_path)
    assert default_sampling_fields("auto", d) == {}  # no file: built-in defaults
    _write(d, {"repetition_penalty": 1.3, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 7,
               "do_sample": True, "eos_token_id": 2})
    assert default_sampling_fields("auto", d) == {"repetition_penalty": 1.3, "temperature": 0.6, "top_k": 20,
                                                  "top_p": 0.95, "max_tokens": 7}
    assert default_sampling_fields("vllm", d) == {}
    other = tmp_path / "other"
    other.mkdir()
    _write(str(other), {"min_p": 0.1})
    assert default_sampling_fields(str(other), d) == {"min_p": 0.1}
    with pytest.raises(ValueError, match="generation_config: .*/nowhere/generation_config.json does not exist"):
        default_sampling_fields(str(tmp_path / "nowhere"), d)
    _write(d, {"top_k": "20"})
    with pytest.raises(ValueError, match=r"generation_config.json: 'top_k' must be an integer, got '20'"):
        default_sampling_fields("auto", d)
    _write(d, [1, 2])
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        default_sampling_fields("auto", d)


def test_llm_and_server_use_the_model_defaults(qwen3_moe_dir: str, tmp_path) -> None:
    d = str(tmp_path / "ckpt")
    shutil.copytree(qwen3_moe_dir, d)
    _write(d, {"temperature": 0.0, "repetition_penalty": 1.5, "max_new_tokens": 12})
    llm = LLM(d, dtype="float32", max_model_len=64)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    by_default = llm.generate(prompt)[0].outputs[0].token_ids
    explicit = SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=12)
    assert by_default == llm.generate(prompt, explicit)[0].outputs[0].token_ids
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].token_ids
    assert len(by_default) == 12 and by_default != plain  # the penalty was applied
    assert LLM(d, dtype="float32", max_model_len=64, generation_config="vllm").get_default_sampling_params() == \
        SamplingParams()

    serving = OpenAIServing(SimpleNamespace(engine=llm.llm_engine), ServerConfig(served_model_names=("m",)))
    unset = CompletionRequest.model_validate({"prompt": "hi"})
    sp = serving.sampling_params(unset, unset.max_tokens, None, 0)
    assert (sp.temperature, sp.repetition_penalty, sp.max_tokens) == (0.0, 1.5, 16)  # OpenAI's max_tokens default
    given = CompletionRequest.model_validate({"prompt": "hi", "temperature": 0.7, "repetition_penalty": 1.0})
    sp = serving.sampling_params(given, given.max_tokens, None, 0)
    assert (sp.temperature, sp.repetition_penalty) == (0.7, 1.0)


def test_auto_dtype_is_float32_on_cpus_without_native_bf16() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert auto_compute_dtype(torch.bfloat16, cpu, native_bf16=False) == torch.float32
    assert auto_compute_dtype(torch.float16, cpu, native_bf16=False) == torch.float32
    assert auto_compute_dtype(torch.bfloat16, cpu, native_bf16=True) == torch.bfloat16
    assert auto_compute_dtype(torch.bfloat16, cuda, native_bf16=False) == torch.bfloat16
    assert auto_compute_dtype(torch.float32, cpu, native_bf16=False) == torch.float32
