"""Checkpoint loading: config normalisation, sharded and single-file safetensors, dtypes,
and errors that name the file and the tensor."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moestream.models.hf_config import model_config_from_hf, model_config_from_dict
from moestream import LLM, SamplingParams
from moestream.config import resolve_dtype


def copy_ckpt(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def test_unknown_model_type_lists_supported(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; supported: qwen3_moe, mixtral"):
        model_config_from_hf(str(tmp_path))


def test_unsupported_rope_type(qwen3_moe_dir: str, tmp_path) -> None:
    d = copy_ckpt(qwen3_moe_dir, str(tmp_path / "m"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="unsupported rope type 'longrope'"):
        model_config_from_hf(d)


def test_config_normalisation(qwen3_moe_dir: str, mixtral_dir: str) -> None:
    q = model_config_from_hf(qwen3_moe_dir)
    assert (q.num_experts, q.num_experts_per_tok, q.head_dim, q.qk_norm, q.norm_topk_prob) == (8, 2, 16, True, True)
    assert q.moe_layers == (True, False, True)  # mlp_only_layers=[1]
    m = model_config_from_hf(mixtral_dir)
    assert (m.num_experts, m.moe_intermediate_size, m.head_dim, m.qk_norm, m.sliding_window) == (8, 48, 16, False, 24)
    # v4-style rope keys are read as well as v5's rope_parameters
    legacy = model_config_from_dict({**_raw(qwen3_moe_dir), "rope_parameters": None, "rope_theta": 5e5,
                                    "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy.rope.rope_type == "linear" and legacy.rope.theta == 5e5 and legacy.rope.get("factor") == 2.0


def _raw(d: str) -> dict:
    return json.load(open(os.path.join(d, "config.json")))


def test_sharded_checkpoint_loads_and_matches(qwen3_moe_dir: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    d = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(qwen3_moe_dir).save_pretrained(d, max_shard_size="5MB")
    for f in os.listdir(qwen3_moe_dir):
        if f.startswith("tokenizer") or f.endswith(".jinja"):
            shutil.copy(os.path.join(qwen3_moe_dir, f), d)
    assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) > 1
    sp = SamplingParams(temperature=0, max_tokens=8)
    a = LLM(qwen3_moe_dir, dtype="float32", max_model_len=64).generate(["shards"], sp)[0].outputs[0].token_ids
    b = LLM(d, dtype="float32", max_model_len=64).generate(["shards"], sp)[0].outputs[0].token_ids
    assert a == b


def test_dtypes(qwen3_moe_dir: str) -> None:
    assert resolve_dtype("auto", "bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", None) == torch.float32
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        resolve_dtype("int8", None)
    llm = LLM(qwen3_moe_dir, dtype="bfloat16", max_model_len=64)
    assert llm.llm_engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in llm.llm_engine.runner.model.parameters())
    out = llm.generate(["bf16"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_missing_tensor_names_it(qwen3_moe_dir: str, tmp_path) -> None:
    d = copy_ckpt(qwen3_moe_dir, str(tmp_path / "m"))
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match="has no tensor 'model.layers.2.mlp.experts.5.up_proj.weight'"):
        LLM(d)


def test_wrong_shape_names_file_and_tensor(qwen3_moe_dir: str, tmp_path) -> None:
    d = copy_ckpt(qwen3_moe_dir, str(tmp_path / "m"))
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight' in '.*model.safetensors' "
                                         r"has shape \[3, 3\], expected \[64, 64\]"):
        LLM(d)


def test_truncated_file_names_it(qwen3_moe_dir: str, tmp_path) -> None:
    d = copy_ckpt(qwen3_moe_dir, str(tmp_path / "m"))
    path = os.path.join(d, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ValueError, match=r"model.safetensors"):
        LLM(d)


def test_garbage_file_names_it(qwen3_moe_dir: str, tmp_path) -> None:
    d = copy_ckpt(qwen3_moe_dir, str(tmp_path / "m"))
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"cannot read the safetensors header of '.*model.safetensors'"):
        LLM(d)


def test_missing_tokenizer(qwen3_moe_dir: str, tmp_path) -> None:
    d = copy_ckpt(qwen3_moe_dir, str(tmp_path / "m"))
    for f in os.listdir(d):
        if f.startswith("tokenizer") or f.endswith(".jinja"):
            os.remove(os.path.join(d, f))
    with pytest.raises(ValueError, match="has no tokenizer: none of tokenizer.json, tokenizer.model, vocab.json"):
        LLM(d)


def test_kv_budget_too_small(qwen3_moe_dir: str) -> None:
    with pytest.raises(ValueError, match="raise kv_cache_memory_bytes to at least"):
        LLM(qwen3_moe_dir, max_model_len=64, kv_cache_memory_bytes=1000)
