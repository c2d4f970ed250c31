"""HF `config.json` -> `ModelConfig`: the fields every decoder has are read here, each model
file (`moestream/models/`) reads its own through `config_fields` (mini-sglang's
models/config.py + register.py split)."""

from __future__ import annotations

import json
import os
from typing import Any

from moestream.config import ModelConfig, RopeConfig, RouterConfig, SUPPORTED_ROPE_TYPES
from moestream.models.config_fields import REQUIRED, HFConfigFields, rope_fields
from moestream.models.registry import MODEL_REGISTRY
from moestream.quantization.config import quantization_from_hf


def model_config_from_hf(model_dir: str) -> ModelConfig:
    """Read `config.json` in `model_dir` and normalise it.

    Raises:
        ValueError: the directory or its config.json is missing or unreadable, or the
            config is invalid (see `model_config_from_dict`; the message names the config.json path).
    """
    path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        raise ValueError(f"model directory '{model_dir}' does not exist; pass a local Hugging Face checkpoint directory")
    if not os.path.isfile(path):
        raise ValueError(f"'{model_dir}' has no config.json; is it a Hugging Face checkpoint directory?")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    return model_config_from_dict(hf, path)

def model_config_from_dict(hf: dict[str, Any], path: str | None = None) -> ModelConfig:
    """Normalise an HF config dict read from `path` (None: not from a file).

    The fields every decoder has are read here; the model file of `model_type` reads
    the rest (`MoEForCausalLM.config_fields`).

    Raises:
        ValueError: the `model_type` is not supported (the message lists the supported
            ones), a `quantization_config` moestream cannot read, a RoPE type is not supported, or a field
            the model type needs is missing, null, of the wrong type (bools are not
            numbers) or out of range. The message names the field and `path`.
    """
    where = f"config.json at {path}" if path else "config"
    if not isinstance(hf, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type not in MODEL_REGISTRY:
        raise ValueError(
            f"{where}: unsupported model_type '{model_type}'; supported: {', '.join(MODEL_REGISTRY)}"
        )
    quant = hf.get("quantization_config")
    quantization = quantization_from_hf(quant, where) if quant is not None else None
    model_class = MODEL_REGISTRY[model_type]
    f, extra = model_class.decoder_fields(HFConfigFields(hf, where, model_class.display_name))
    hidden = f.integer("hidden_size", minimum=1)
    heads = f.integer("num_attention_heads", minimum=1)
    num_layers = f.integer("num_hidden_layers", minimum=1)
    common: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=f.integer("vocab_size", minimum=1),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=f.integer("num_key_value_heads", default=heads, minimum=1),
        head_dim=f.integer("head_dim", default=None, minimum=1) or hidden // heads,
        num_experts_per_tok=f.integer("num_experts_per_tok", minimum=1),
        rms_norm_eps=f.number("rms_norm_eps", default=1e-6),
        rope=_rope_from_hf(f),
        max_position_embeddings=f.integer("max_position_embeddings", default=4096, minimum=1),
        attention_bias=f.flag("attention_bias", default=False),
        sliding_window=None,
        tie_word_embeddings=f.flag("tie_word_embeddings", default=False),
        hidden_act=f.get("hidden_act", str, default="silu"),
        torch_dtype=f.get("torch_dtype", str, default=None) or f.get("dtype", str, default=None),
        bos_token_id=f.integer("bos_token_id", default=None),
    )
    eos = f.get("eos_token_id", (int, list), default=None)
    common["eos_token_ids"] = f.integers("eos_token_id") if isinstance(eos, list) else (() if eos is None else (eos,))
    common.update(extra)
    common.update(model_class.config_fields(f, common))
    if "intermediate_size" not in common:  # the dense MLP's size is needed only when some layer is dense
        dense = not all(common["moe_layers"])
        common["intermediate_size"] = f.integer("intermediate_size", default=REQUIRED if dense else 0,
                                                minimum=int(dense))
    if common.get("o_proj_bias") is None:
        common["o_proj_bias"] = common["attention_bias"]
    _check_model_fields(f, common)
    return ModelConfig(**common, quantization=quantization)


def _check_model_fields(f: "HFConfigFields", c: dict[str, Any]) -> None:
    """Checks across fields of a normalised config `c` (read from `f`), so that a config the
    model cannot run fails at start-up, naming the field, rather than at its first request.

    Raises:
        ValueError: top-k above the expert count, a router group layout that does not fit
            the experts, a partial rotary factor outside (0, 1] or giving an odd rotary dim,
            an odd MLA rope head dim, or a non-positive routed_scaling_factor.
    """
    experts, top_k = c["num_experts"], c["num_experts_per_tok"]
    if experts and top_k > experts:
        raise f.error("num_experts_per_tok", f"is {top_k}, more than the {experts} routed experts")
    router: RouterConfig = c.get("router", RouterConfig())
    if router.routed_scaling_factor <= 0:
        raise f.error("routed_scaling_factor", f"must be positive, got {router.routed_scaling_factor}")
    if router.topk_method != "greedy":
        if experts % router.n_group:
            raise f.error("n_group", f"is {router.n_group}; it must divide the {experts} routed experts")
        if router.topk_method == "noaux_tc" and experts // router.n_group < 2:
            raise f.error("n_group", f"is {router.n_group}; groups are ranked by their top-2 experts, so each of "
                                     f"them needs at least 2 of the {experts} routed experts")
        if router.topk_group > router.n_group:
            raise f.error("topk_group", f"is {router.topk_group}, more than the n_group {router.n_group} groups")
    factor = c.get("partial_rotary_factor", 1.0)
    if c.get("mla") is None and not (0 < factor <= 1 and int(c["head_dim"] * factor) % 2 == 0):
        raise f.error("partial_rotary_factor", f"is {factor}; it must be in (0, 1] and give an even number of "
                                               f"rotary dims of the {c['head_dim']}-dim heads")
    if c.get("mla") is not None and c["mla"].qk_rope_head_dim % 2:
        raise f.error("qk_rope_head_dim", f"is {c['mla'].qk_rope_head_dim}; rotary dims come in pairs, so it must be even")


# Numeric keys of the RoPE scaling types moestream implements (moestream/layers/rotary.py).
_ROPE_NUMBERS = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                 "attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow")


def _rope_from_hf(f: HFConfigFields) -> RopeConfig:
    """Both HF layouts: v5 `rope_parameters` and v4 `rope_theta` + `rope_scaling`.

    Raises:
        ValueError: an unsupported rope type, or a mistyped rope field (see `HFConfigFields`).
    """
    rope = rope_fields(f)
    params = dict(rope.hf)
    theta = rope.number("rope_theta", default=None)
    params.pop("rope_theta", None)
    if theta is None:
        theta = f.number("rope_theta", default=10000.0)
    rope_type = rope.get("rope_type", str, "type", default="default")
    params.pop("rope_type", None)
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{f.where}: unsupported rope type '{rope_type}'; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    for key in _ROPE_NUMBERS:
        rope.number(key, default=None)
    for key in _ROPE_REQUIRED.get(rope_type, ()):
        if rope.hf.get(key) is None:
            raise rope.error(key, f"is missing; rope type '{rope_type}' needs {', '.join(_ROPE_REQUIRED[rope_type])}")
    if rope_type != "default" and rope.number("factor") <= 0:
        raise rope.error("factor", f"must be positive, got {rope.number('factor')}")
    return RopeConfig(rope_type=rope_type, theta=theta, params=tuple(sorted(params.items())))


# Keys each scaled rope type cannot do without (transformers' modeling_rope_utils.py reads them unguarded).
_ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
