"""Broken checkpoints give one readable ValueError naming the file and the field or tensor:
config.json fields that are missing, null, mistyped or out of range, and weights that are
not floating point (quantized checkpoints), for dense weights, resident and paged experts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from moestream.models.hf_config import model_config_from_hf
from moestream import LLM

# fixture name -> (display name in errors, fields its config.json must have)
COMMON = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "num_experts_per_tok")
REQUIRED: dict[str, tuple[str, tuple[str, ...]]] = {
    # the Qwen3-MoE and Qwen3-Next fixtures have a dense layer (mlp_only_layers=[1]), so intermediate_size is needed
    "qwen3_moe": ("Qwen3-MoE", (*COMMON, "moe_intermediate_size", "intermediate_size")),
    "mixtral": ("Mixtral", (*COMMON, "num_local_experts", "intermediate_size")),
    "qwen3_next": ("Qwen3-Next", (*COMMON, "num_experts", "moe_intermediate_size", "intermediate_size")),
    "qwen3_5_moe": ("Qwen3.5-MoE", (*COMMON, "num_experts", "moe_intermediate_size")),
    "qwen3_5_moe_vl": ("Qwen3.5-MoE", (*COMMON, "num_experts", "moe_intermediate_size")),
    "granite": ("Granite-4.0-H", (*COMMON, "num_local_experts", "intermediate_size", "shared_intermediate_size",
                                  "mamba_n_heads", "mamba_d_head", "mamba_d_state")),
    # the layer count comes from layers_block_type, so num_hidden_layers is not needed
    "nemotron_h": ("Nemotron-H", ("hidden_size", "num_attention_heads", "vocab_size", "num_experts_per_tok",
                                  "n_routed_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
                                  "intermediate_size", "mamba_num_heads", "mamba_head_dim", "ssm_state_size")),
    # its config.json names fields as KimiLinearConfig.attribute_map does (num_experts_per_token, ...)
    "kimi_linear": ("Kimi-Linear", ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                                    "num_experts_per_token", "num_experts", "moe_intermediate_size",
                                    "intermediate_size")),
}
CASES = [(model, field) for model, (_, fields) in REQUIRED.items() for field in fields]


def _hf_config(request: pytest.FixtureRequest, model: str) -> dict[str, Any]:
    """The fixture checkpoint's config.json; for `qwen3_5_moe_vl`, the text config nested as
    the multimodal class nests it (text_config, with tie_word_embeddings outside)."""
    if model == "qwen3_5_moe_vl":
        text = _hf_config(request, "qwen3_5_moe")
        tie = text.pop("tie_word_embeddings")
        return {"model_type": "qwen3_5_moe", "tie_word_embeddings": tie, "text_config": text}
    with open(os.path.join(request.getfixturevalue(f"{model}_dir"), "config.json")) as f:
        return json.load(f)


def _set(cfg: dict[str, Any], model: str, field: str, value: Any) -> str:
    """Set (or, for value `...`, delete) `field` of the decoder config; returns the field's name in errors."""
    target = cfg["text_config"] if model == "qwen3_5_moe_vl" else cfg
    if value is ...:
        target.pop(field, None)
    else:
        target[field] = value
    return f"text_config.{field}" if model == "qwen3_5_moe_vl" else field


def _write(tmp_path, cfg: dict[str, Any]) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path / "config.json")


def _expect(path: str, message: str) -> str:
    return re.escape(f"config.json at {path}: {message}")


@pytest.mark.parametrize("model", list(REQUIRED))
def test_fixture_configs_are_valid(request: pytest.FixtureRequest, tmp_path, model: str) -> None:
    """The unbroken configs load, so the failures below are due to the one field each breaks."""
    _write(tmp_path, _hf_config(request, model))
    cfg = model_config_from_hf(str(tmp_path))
    assert cfg.hidden_size == 64 and cfg.num_experts == 8
    prefixes = {"qwen3_5_moe_vl": "model.language_model.", "nemotron_h": "backbone."}
    assert cfg.weight_prefix == prefixes.get(model, "model.")


@pytest.mark.parametrize(("model", "field"), CASES)
def test_missing_required_field_names_it_and_the_file(
    request: pytest.FixtureRequest, tmp_path, model: str, field: str
) -> None:
    cfg = _hf_config(request, model)
    name = _set(cfg, model, field, ...)
    path = _write(tmp_path, cfg)
    message = f"field '{name}' is missing; a {REQUIRED[model][0]} config needs it"
    with pytest.raises(ValueError, match=_expect(path, message)):
        model_config_from_hf(str(tmp_path))


@pytest.mark.parametrize(("model", "field"), CASES)
def test_mistyped_required_field_names_it_and_the_file(
    request: pytest.FixtureRequest, tmp_path, model: str, field: str
) -> None:
    cfg = _hf_config(request, model)
    good = (cfg["text_config"] if model == "qwen3_5_moe_vl" else cfg)[field]
    for bad in (str(good), True, float(good)):  # bools are not integers; neither is 64.0
        name = _set(cfg, model, field, bad)
        path = _write(tmp_path, cfg)
        message = f"field '{name}' must be an integer, got {type(bad).__name__} {bad!r}"
        with pytest.raises(ValueError, match=_expect(path, message)):
            model_config_from_hf(str(tmp_path))


def test_qwen3_moe_without_any_expert_count(request: pytest.FixtureRequest, tmp_path) -> None:
    cfg = _hf_config(request, "qwen3_moe")
    cfg.pop("num_experts", None)
    cfg.pop("num_local_experts")
    path = _write(tmp_path, cfg)
    message = "field 'num_experts' (or 'num_local_experts') is missing; a Qwen3-MoE config needs it"
    with pytest.raises(ValueError, match=_expect(path, message)):
        model_config_from_hf(str(tmp_path))


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("hidden_size", None, "is null; a Qwen3-MoE config needs it"),
        ("num_attention_heads", 0, "must be at least 1, got 0"),
        ("decoder_sparse_step", 0, "must be at least 1, got 0"),
        ("rms_norm_eps", "1e-6", "must be a number, got str '1e-6'"),
        ("rms_norm_eps", False, "must be a number, got bool False"),
        ("norm_topk_prob", "true", "must be true or false, got str 'true'"),
        ("norm_topk_prob", 1, "must be true or false, got int 1"),
        ("hidden_act", 1, "must be a string, got int 1"),
        ("mlp_only_layers", [1, "2"], "must be a list of integers, got [1, '2']"),
        ("eos_token_id", "2", "must be an integer or a list of integers, got str '2'"),
        ("rope_parameters", [], "must be an object, got list []"),
    ],
)
def test_bad_optional_field_names_it_and_the_file(
    request: pytest.FixtureRequest, tmp_path, field: str, value: Any, problem: str
) -> None:
    cfg = _hf_config(request, "qwen3_moe")
    cfg[field] = value
    path = _write(tmp_path, cfg)
    with pytest.raises(ValueError, match=_expect(path, f"field '{field}' {problem}")):
        model_config_from_hf(str(tmp_path))


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("mamba_n_groups", 3, "is 3; it must divide the 4 mamba_n_heads"),
    ("mamba_d_head", 16, "is 16: mamba_n_heads x mamba_d_head (64) must equal mamba_expand x hidden_size (128)"),
    ("time_step_limit", [1.0, 0.5], "must be two numbers 0 <= min <= max, got [1.0, 0.5]"),
    ("position_embedding_type", "alibi", "must be 'rope', 'nope' or null, got 'alibi'"),
    ("layer_types", ["mamba", "attention", "mamba"], "must list 'mamba' or 'attention' for each of the 4 layers"),
])
def test_bad_granite_field_names_it(request: pytest.FixtureRequest, tmp_path, field: str, value: Any,
                                    problem: str) -> None:
    cfg = _hf_config(request, "granite")
    cfg[field] = value
    path = _write(tmp_path, cfg)
    with pytest.raises(ValueError, match=_expect(path, f"field '{field}' {problem}")):
        model_config_from_hf(str(tmp_path))


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("layers_block_type", ["linear_attention", "dense"], "must list one of linear_attention, full_attention, moe, "
                                                         "mlp per layer; got ['linear_attention', 'dense']"),
    ("layers_block_type", ..., "(or 'hybrid_override_pattern') is missing; a Nemotron-H config needs it"),
    ("n_groups", 3, "is 3; it must divide the 4 mamba_num_heads"),
    ("mlp_hidden_act", "silu", "is 'silu'; moestream supports Nemotron-H with 'relu2' only"),
    ("moe_latent_size", 32, "is set: latent MoE projections (Nemotron 3 Super) are not supported yet"),
])
def test_bad_nemotron_h_field_names_it(request: pytest.FixtureRequest, tmp_path, field: str, value: Any,
                                       problem: str) -> None:
    cfg = _hf_config(request, "nemotron_h")
    _set(cfg, "nemotron_h", field, value)
    path = _write(tmp_path, cfg)
    with pytest.raises(ValueError, match=_expect(path, f"field '{field}' {problem}")):
        model_config_from_hf(str(tmp_path))


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("layer_types", ["linear_attention"] * 3, "must list 'linear_attention' or 'full_attention' for each of the 4 "
                                              "layers; got ['linear_attention', 'linear_attention', 'linear_attention']"),
    ("mlp_layer_types", ["dense", "moe", "sparse", "sparse"], "must list 'dense' or 'sparse' for each of the 4 "
                                                              "layers; got ['dense', 'moe', 'sparse', 'sparse']"),
    ("num_expert_group", 3, "is 3; it must divide the 8 routed experts"),
])
def test_bad_kimi_linear_field_names_it(request: pytest.FixtureRequest, tmp_path, field: str, value: Any,
                                        problem: str) -> None:
    cfg = _hf_config(request, "kimi_linear")
    cfg[field] = value
    path = _write(tmp_path, cfg)
    with pytest.raises(ValueError, match=_expect(path, f"field '{field}' {problem}")):
        model_config_from_hf(str(tmp_path))


def test_kimi_linear_hub_layer_lists_equal_layer_types(request: pytest.FixtureRequest, tmp_path) -> None:
    """The hub's config gives the layer kinds as 1-indexed `linear_attn_config` lists and the
    dense layers as `first_k_dense_replace`."""
    cfg = _hf_config(request, "kimi_linear")
    types, mlp = cfg.pop("layer_types"), cfg.pop("mlp_layer_types")
    cfg.update(first_k_dense_replace=1, linear_attn_config=dict(kda_layers=[1, 3, 4], full_attn_layers=[2], head_dim=16,
                                                                num_heads=4, short_conv_kernel_size=4))
    for key in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
        cfg.pop(key)
    _write(tmp_path, cfg)
    parsed = model_config_from_hf(str(tmp_path))
    assert parsed.layer_types == tuple(types) and parsed.moe_layers == tuple(t == "sparse" for t in mlp)
    assert (parsed.linear_num_value_heads, parsed.linear_value_head_dim, parsed.linear_conv_kernel_dim) == (4, 16, 4)
    cfg["linear_attn_config"]["full_attn_layers"] = [2, 3]
    path = _write(tmp_path, cfg)
    with pytest.raises(ValueError, match=_expect(path, "field 'linear_attn_config.kda_layers' and full_attn_layers "
                                                       "must number the 4 layers from 1 once each")):
        model_config_from_hf(str(tmp_path))


def test_nemotron_h_pattern_string_equals_the_block_list(request: pytest.FixtureRequest, tmp_path) -> None:
    """Older Nemotron-H configs give the layers as `hybrid_override_pattern` (M * E -)."""
    cfg = _hf_config(request, "nemotron_h")
    types = cfg.pop("layers_block_type")
    cfg["hybrid_override_pattern"] = "M E*ME-".replace(" ", "")
    _write(tmp_path, cfg)
    parsed = model_config_from_hf(str(tmp_path))
    assert parsed.layer_types == tuple(types) and parsed.num_layers == 6
    assert parsed.moe_layers == (False, True, False, False, True, False)
    assert (parsed.attention_layers, parsed.linear_layers) == ([2], [0, 3])
    cfg["hybrid_override_pattern"] = "MEX"
    path = _write(tmp_path, cfg)
    with pytest.raises(ValueError, match=_expect(path, "field 'hybrid_override_pattern' must be a non-empty string "
                                                       "of M, *, E and -; got 'MEX'")):
        model_config_from_hf(str(tmp_path))


def test_bad_rope_field_names_its_section(request: pytest.FixtureRequest, tmp_path) -> None:
    cfg = _hf_config(request, "qwen3_5_moe_vl")
    cfg["text_config"]["rope_parameters"]["rope_theta"] = "1e6"
    path = _write(tmp_path, cfg)
    message = "field 'text_config.rope_parameters.rope_theta' must be a number, got str '1e6'"
    with pytest.raises(ValueError, match=_expect(path, message)):
        model_config_from_hf(str(tmp_path))
    cfg["text_config"]["rope_parameters"]["rope_theta"] = 1e6
    cfg["text_config"]["rope_scaling"] = {"rope_type": "linear", "factor": "2"}
    path = _write(tmp_path, cfg)
    message = "field 'text_config.rope_scaling.factor' must be a number, got str '2'"
    with pytest.raises(ValueError, match=_expect(path, message)):
        model_config_from_hf(str(tmp_path))


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: str, **changes: Any) -> str:
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def test_mistyped_field_is_not_blamed_on_the_tokenizer(qwen3_moe_dir: str, tmp_path) -> None:
    d = _copy(qwen3_moe_dir, str(tmp_path / "m"))
    path = _edit_config(d, hidden_size="64")
    with pytest.raises(ValueError, match=_expect(path, "field 'hidden_size' must be an integer, got str '64'")):
        LLM(d)


TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers < 5 does not validate config fields")
def test_field_rejected_by_transformers_is_not_blamed_on_the_tokenizer(qwen3_moe_dir: str, tmp_path) -> None:
    # a field moestream does not read, but AutoTokenizer's config validation does
    d = _copy(qwen3_moe_dir, str(tmp_path / "m"))
    path = _edit_config(d, initializer_range="x")
    with pytest.raises(ValueError, match=_expect(path, "transformers rejects it: ") + ".*initializer_range") as e:
        LLM(d)
    assert "tokenizer" not in str(e.value) and "\n" not in str(e.value)


def test_cli_prints_one_line_error_for_a_broken_config(qwen3_moe_dir: str, tmp_path) -> None:
    d = _copy(qwen3_moe_dir, str(tmp_path / "m"))
    os.remove(os.path.join(d, "model.safetensors"))  # never reached: the config is read first
    path = _edit_config(d, num_hidden_layers=None)
    proc = subprocess.run([sys.executable, "-m", "moestream.server.cli", "generate", "--model", d, "hi"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"error: config.json at {path}: field 'num_hidden_layers' is null; a Qwen3-MoE config needs it"]


EXPERT = "model.layers.0.mlp.experts.3.up_proj.weight"
DENSE = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize(
    ("tensor", "dtype", "llm_kwargs"),
    [
        (DENSE, torch.int8, {}),
        (EXPERT, torch.int32, {}),  # resident expert store
        (EXPERT, torch.bool, {}),
        (EXPERT, torch.uint8, {"expert_budget": 0.5}),  # paged expert store
        (EXPERT, torch.int8, {"expert_budget": 0.5}),
    ],
    ids=["dense-int8", "resident-int32", "resident-bool", "paged-uint8", "paged-int8"],
)
def test_integer_weights_are_refused(
    qwen3_moe_dir: str, tmp_path, tensor: str, dtype: torch.dtype, llm_kwargs: dict[str, Any]
) -> None:
    d = _copy(qwen3_moe_dir, str(tmp_path / "m"))
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors[tensor] = (tensors[tensor] * 100).to(dtype)  # same shape; the values an int8 quantizer might store
    save_file(tensors, path)
    name = str(dtype).removeprefix("torch.")
    message = (f"tensor '{tensor}' in '{path}' has dtype {name}; moestream loads only floating-point weights "
               "(float32, bfloat16, float16, float64) unless config.json's quantization_config names the format")
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(d, dtype="float32", max_model_len=64, **llm_kwargs)


def test_float16_weights_still_load(qwen3_moe_dir: str, tmp_path) -> None:
    """The dtype check refuses only non-float weights: a float16 checkpoint loads in float32."""
    d = _copy(qwen3_moe_dir, str(tmp_path / "m"))
    path = os.path.join(d, "model.safetensors")
    save_file({k: v.half() for k, v in load_file(path).items()}, path)
    llm = LLM(d, dtype="float32", max_model_len=64, expert_budget=0.5)
    assert all(p.dtype == torch.float32 for p in llm.llm_engine.runner.model.parameters())
