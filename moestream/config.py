"""Configuration: `ModelConfig.from_hf` (the one place HF config names are read) and `EngineConfig`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from moestream.validation import is_int

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
# Hybrid models: gated full attention + Gated DeltaNet linear attention + MoE with a shared expert.
HYBRID_MODEL_TYPES: tuple[str, ...] = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "yarn", "llama3")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from HF's `rope_parameters` / `rope_scaling` + `rope_theta`.

    `rope_type` is one of SUPPORTED_ROPE_TYPES; `params` keeps the remaining HF keys
    (factor, original_max_position_embeddings, beta_fast, ...), as a sorted tuple of pairs.
    """

    rope_type: str
    theta: float
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of an MoE decoder, with HF attribute names normalised.

    All sizes are element counts. `moe_layers[i]` is True when layer i has a routed-expert
    MoE block, False when it has a dense MLP of `intermediate_size`.

    Hybrid models (Qwen3-Next, Qwen3.5-MoE) also set: `layer_types[i]` "full_attention" or
    "linear_attention" (Gated DeltaNet); the `linear_*` sizes of the GDN layers;
    `shared_expert_intermediate_size` (0 = no shared expert); `attn_output_gate` (q_proj
    doubled to give a sigmoid output gate); `partial_rotary_factor` (RoPE on the first
    fraction of head_dim); `norm_unit_offset` (RMSNorm scales by 1 + weight); and
    `weight_prefix`, the checkpoint prefix of the decoder ("model." or, for Qwen3.5-MoE's
    multimodal class, "model.language_model.").
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    qk_norm: bool
    attention_bias: bool
    sliding_window: int | None
    tie_word_embeddings: bool
    hidden_act: str
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    layer_types: tuple[str, ...] = ()
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    shared_expert_intermediate_size: int = 0
    attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    norm_unit_offset: bool = False
    weight_prefix: str = "model."

    @property
    def is_hybrid(self) -> bool:
        """True when some layers are linear attention (they keep a state, not a KV cache)."""
        return "linear_attention" in self.layer_types

    @property
    def attention_layers(self) -> list[int]:
        """Decoder indices of full-attention layers (the only ones with a KV cache)."""
        if not self.layer_types:
            return list(range(self.num_layers))
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_layers(self) -> list[int]:
        """Decoder indices of linear-attention (Gated DeltaNet) layers."""
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @staticmethod
    def from_hf(model_dir: str) -> "ModelConfig":
        """Read `config.json` in `model_dir` and normalise it.

        Raises:
            ValueError: the directory or its config.json is missing or unreadable, the
                `model_type` is not supported (the message lists the supported ones), or a
                RoPE type is not supported.
        """
        path = os.path.join(model_dir, "config.json")
        if not os.path.isdir(model_dir):
            raise ValueError(f"model directory '{model_dir}' does not exist; pass a local Hugging Face checkpoint directory")
        if not os.path.isfile(path):
            raise ValueError(f"'{model_dir}' has no config.json; is it a Hugging Face checkpoint directory?")
        try:
            with open(path) as f:
                hf = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {path}: {e}") from e
        return ModelConfig.from_dict(hf)

    @staticmethod
    def from_dict(hf: dict[str, Any]) -> "ModelConfig":
        """Normalise an HF config dict (see `from_hf`)."""
        model_type = hf.get("model_type")
        weight_prefix = "model."
        if model_type == "qwen3_5_moe" and isinstance(hf.get("text_config"), dict):
            # The multimodal class: the decoder is `model.language_model.`; vision is not loaded.
            outer = hf
            hf = {**hf["text_config"]}
            for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
                if hf.get(key) is None and outer.get(key) is not None:
                    hf[key] = outer[key]
            weight_prefix = "model.language_model."
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type '{model_type}'; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        num_layers = int(hf["num_hidden_layers"])
        head_dim = hf.get("head_dim") or hidden // heads
        hybrid: dict[str, Any] = {}
        if model_type in HYBRID_MODEL_TYPES:
            hybrid = _hybrid_from_hf(hf, model_type, num_layers, weight_prefix)
            num_experts = int(hf["num_experts"])
            moe_layers = hybrid.pop("moe_layers")
            moe_inter = int(hf["moe_intermediate_size"])
            norm_topk = hybrid.pop("norm_topk_prob")
            qk_norm = True
            sliding = None
        elif model_type == "qwen3_moe":
            num_experts = int(hf.get("num_experts") or hf.get("num_local_experts"))
            step = int(hf.get("decoder_sparse_step", 1))
            mlp_only = set(hf.get("mlp_only_layers") or [])
            moe_layers = tuple(
                (i not in mlp_only) and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
            )
            moe_inter = int(hf["moe_intermediate_size"])
            norm_topk = bool(hf.get("norm_topk_prob", False))
            qk_norm = True
            sliding = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        else:  # mixtral
            num_experts = int(hf["num_local_experts"])
            moe_layers = (True,) * num_layers
            moe_inter = int(hf["intermediate_size"])
            norm_topk = True
            qk_norm = False
            sliding = hf.get("sliding_window")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(hf.get("intermediate_size") or 0),
            moe_intermediate_size=moe_inter,
            num_experts=num_experts,
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            norm_topk_prob=norm_topk,
            moe_layers=moe_layers,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            qk_norm=qk_norm,
            attention_bias=bool(hf.get("attention_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            hidden_act=str(hf.get("hidden_act", "silu")),
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            **hybrid,
        )


def _hybrid_from_hf(hf: dict[str, Any], model_type: str, num_layers: int, weight_prefix: str) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5-MoE fields (transformers' configuration_qwen3_next.py and
    configuration_qwen3_5_moe.py, including their defaults)."""
    layer_types = hf.get("layer_types")
    if layer_types is None:
        interval = int(hf.get("full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or set(layer_types) - {"linear_attention", "full_attention"}:
        raise ValueError(
            f"layer_types must list 'full_attention' or 'linear_attention' for each of the {num_layers} layers; "
            f"got {layer_types}"
        )
    if model_type == "qwen3_next":
        step = int(hf.get("decoder_sparse_step", 1))
        mlp_only = set(hf.get("mlp_only_layers") or [])
        num_experts = int(hf["num_experts"])
        moe_layers = tuple((i not in mlp_only) and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
        norm_topk = bool(hf.get("norm_topk_prob", True))
    else:  # Qwen3.5-MoE: every layer is sparse, top-k always renormalised
        moe_layers = (True,) * num_layers
        norm_topk = True
    rope = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    return dict(
        moe_layers=moe_layers,
        norm_topk_prob=norm_topk,
        layer_types=tuple(layer_types),
        linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(hf.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(hf.get("linear_value_head_dim", 128)),
        linear_num_key_heads=int(hf.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(hf.get("linear_num_value_heads", 32)),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        attn_output_gate=True,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
        norm_unit_offset=True,
        weight_prefix=weight_prefix,
    )


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    """Both HF layouts: v5 `rope_parameters` and v4 `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params.update(scaling)
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type '{rope_type}' in config; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(rope_type=rope_type, theta=theta, params=tuple(sorted(params.items())))


def resolve_dtype(dtype: str | torch.dtype, config_dtype: str | None) -> torch.dtype:
    """Map a user dtype ("float32", "bfloat16", "float16" or "auto") to a torch dtype.

    "auto" takes the checkpoint's `torch_dtype`, and float32 when it has none.

    Raises:
        ValueError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16, float16 or auto")
        return dtype
    if dtype == "auto":
        return _DTYPES.get(str(config_dtype), torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype '{dtype}'; use float32, bfloat16, float16 or auto")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings, named as vLLM names them.

    Attributes:
        model: checkpoint directory.
        dtype: "auto", "float32", "bfloat16" or "float16".
        device: torch device string, e.g. "cpu" or "cuda:0".
        max_model_len: max tokens per sequence (prompt + output); None = the model's
            max_position_embeddings.
        max_num_seqs: max requests running in one step.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        block_size: tokens per KV cache block.
        kv_cache_memory_bytes: bytes for the KV cache; None = enough for max_num_seqs
            sequences of max_model_len, capped at 4 GiB.
        seed: seed of the sampler's generator for requests without their own seed.
        max_logprobs: the most logprobs a request may ask for per token (vLLM's default, 20).
        expert_budget: device memory for routed experts: a fraction in (0, 1] of all their
            bytes, or an int number of bytes; None = all resident.
        expert_host_cache_bytes: bytes of host memory caching experts between disk and device.
        expert_policy: eviction policy of the device slots: "lru", "lfu" or "activation".
        expert_prefetch: "gate" (next layer's router on this layer's input), "history"
            (co-activation statistics), "none", or "auto": gate on CUDA, none on CPU, where
            the prefetch thread competes with compute for the cores (bench/results/expert_offload.md).
            Only used when experts are paged.
        expert_pin_profile: JSON file {"layer": [expert ids]} of experts kept resident.
        record_routing: file to write the routing trace (request, token, layer, experts) to.
        max_resident_states: hybrid (linear-attention) models only: how many requests keep
            their conv/recurrent states on the device; the rest wait in host memory and are
            swapped back in before their next forward. None = max_num_seqs.
        mamba_ssm_cache_dtype: dtype of the linear-attention recurrent state (vLLM's name):
            "float32" (default), "bfloat16", "float16" or "auto" (the model dtype).
    """

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    seed: int = 0
    max_logprobs: int = 20
    expert_budget: float | int | None = None
    expert_host_cache_bytes: int = 0
    expert_policy: str = "lru"
    expert_prefetch: str = "auto"
    expert_pin_profile: str | None = None
    record_routing: str | None = None
    max_resident_states: int | None = None
    mamba_ssm_cache_dtype: str = "float32"

    @property
    def resolved_expert_prefetch(self) -> str:
        """`expert_prefetch` with "auto" resolved for the device."""
        if self.expert_prefetch != "auto":
            return self.expert_prefetch
        return "gate" if torch.device(self.device).type == "cuda" else "none"

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be a checkpoint directory path, got {self.model!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_logprobs"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer of at least 2, got {self.max_model_len!r}")
        if self.max_resident_states is not None and (
            not is_int(self.max_resident_states) or self.max_resident_states < 1
        ):
            raise ValueError(f"max_resident_states must be a positive integer, got {self.max_resident_states!r}")
        if self.kv_cache_memory_bytes is not None and (
            not is_int(self.kv_cache_memory_bytes) or self.kv_cache_memory_bytes <= 0
        ):
            raise ValueError(f"kv_cache_memory_bytes must be a positive integer (bytes), got {self.kv_cache_memory_bytes!r}")
        if self.expert_prefetch not in ("auto", "none", "gate", "history"):
            raise ValueError(f"unknown expert prefetch mode '{self.expert_prefetch}'; use auto, none, gate or history")
        if self.mamba_ssm_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"mamba_ssm_cache_dtype must be auto, float32, bfloat16 or float16; got {self.mamba_ssm_cache_dtype!r}"
            )
        if self.expert_policy not in ("lru", "lfu", "activation"):
            raise ValueError(f"unknown expert policy '{self.expert_policy}'; use lru, lfu or activation")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.dtype, (str, torch.dtype)):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {self.device!r}") from e
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device '{self.device}' was asked for, but this torch build sees no CUDA device; use device='cpu'")

