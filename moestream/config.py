"""Configuration: `ModelConfig.from_hf` (the one place HF config names are read) and `EngineConfig`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from moestream.demo import resolve_model
from moestream.experts.policy import POLICY_NAMES
from moestream.validation import is_int, is_number

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
class MultiModalConfig:
    """The vision side of a multimodal checkpoint (Qwen3.5-MoE's `Qwen3_5MoeForConditionalGeneration`).

    Token ids of the placeholders the chat template writes (`image_token_id`,
    `video_token_id`, inside `vision_start_token_id` ... `vision_end_token_id`);
    `spatial_merge_size` (2 x 2 patches become one language-model token),
    `patch_size` and `temporal_patch_size` in pixels / frames; `mrope_section`: how many
    rotary frequencies take the temporal, height and width position (interleaved T H W T H W
    ..., as HF's `Qwen3_5MoeTextRotaryEmbedding`); `vision_config`: the HF vision config
    dict, for transformers' vision module class.
    """

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int
    patch_size: int
    temporal_patch_size: int
    mrope_section: tuple[int, int, int]
    vision_config: dict


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434), HF's DeepseekV2/V3 names.

    `q_lora_rank` None: queries come from one `q_proj` (V2-Lite); else through a
    `q_lora_rank` bottleneck. Keys and values are expanded from a `kv_lora_rank` latent by
    `kv_b_proj`; a `qk_rope_head_dim` rope key is shared by all heads. `rope_interleave`:
    rotary pairs are adjacent dims (x0, x1), (x2, x3) ... (DeepSeek's layout) instead of
    rotate-half. `softmax_scale`: qk_head_dim ** -0.5, times yarn's mscale(factor,
    mscale_all_dim) squared when the rope is yarn (HF `yarn_apply_mscale`).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @property
    def cache_dim(self) -> int:
        """Values per token and layer in the latent KV cache: the latent plus the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class RouterConfig:
    """How the MoE router picks and weighs experts (HF's DeepseekV2/V3 and Glm4Moe routers;
    the defaults are Qwen3-MoE's and Mixtral's softmax top-k).

    `scoring_func`: "softmax" or "sigmoid". `topk_method`: "greedy" (top-k of the scores),
    "group_limited_greedy" (DeepSeek-V2: experts of the `topk_group` groups with the highest
    max score), or "noaux_tc" (DeepSeek-V3, GLM-4.5: selection by score +
    `e_score_correction_bias`, groups ranked by the sum of their top-2). `n_group` groups of
    num_experts / n_group experts. `routed_scaling_factor` multiplies the routed weights.
    `float32`: the router runs in float32 whatever the model dtype, HF's
    `_keep_in_fp32_modules_strict` (DeepSeek, GLM); else in the model dtype (Qwen, Mixtral),
    and top-k comes out sorted (HF's `torch.topk` default) rather than unsorted.
    """

    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    float32: bool = False

    @property
    def has_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of an MoE decoder, with HF attribute names normalised.

    All sizes are element counts. `moe_layers[i]` is True when layer i has a routed-expert
    MoE block, False when it has a dense MLP of `intermediate_size`. Each model file
    (`moestream/models/`) reads its own fields (`MoEForCausalLM.config_fields`).

    Hybrid models (Qwen3-Next, Qwen3.5-MoE) also set: `layer_types[i]` "full_attention" or
    "linear_attention" (Gated DeltaNet); the `linear_*` sizes of the GDN layers;
    `attn_output_gate` (q_proj doubled to give a sigmoid output gate); `norm_unit_offset`
    (RMSNorm scales by 1 + weight); and `weight_prefix`, the checkpoint prefix of the
    decoder ("model." or, for Qwen3.5-MoE's multimodal class, "model.language_model.").
    `multimodal`: the vision tower's settings when the checkpoint has one.

    Shared experts: `shared_expert_intermediate_size` (0 = none); `shared_expert_gate`
    True scales it by sigmoid(shared_expert_gate(x)) (Qwen3-Next `shared_expert`), False
    adds it as is (DeepSeek / GLM `shared_experts`). `partial_rotary_factor`: RoPE on the
    first fraction of head_dim. `o_proj_bias`: the attention output projection has a bias
    (Qwen3-MoE: as `attention_bias`; GLM-4.5: never). `mla`: DeepSeek's latent attention
    (then `head_dim` is the rope head dim, as HF sets it). `router`: the routing method.
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
    shared_expert_gate: bool = False
    attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    norm_unit_offset: bool = False
    weight_prefix: str = "model."
    multimodal: MultiModalConfig | None = None
    o_proj_bias: bool | None = None
    mla: MLAConfig | None = None
    router: RouterConfig = RouterConfig()

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

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(heads, key dim, value dim) of one token's KV cache entry per layer. MLA caches
        one latent head of `kv_lora_rank + qk_rope_head_dim` and no separate value (the
        values are the latent's first `kv_lora_rank` dims)."""
        if self.mla is not None:
            return 1, self.mla.cache_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim

    @staticmethod
    def from_hf(model_dir: str) -> "ModelConfig":
        """Read `config.json` in `model_dir` and normalise it.

        Raises:
            ValueError: the directory or its config.json is missing or unreadable, or the
                config is invalid (see `from_dict`; the message names the config.json path).
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
        return ModelConfig.from_dict(hf, path)

    @staticmethod
    def from_dict(hf: dict[str, Any], path: str | None = None) -> "ModelConfig":
        """Normalise an HF config dict read from `path` (None: not from a file).

        The fields every decoder has are read here; the model file of `model_type` reads
        the rest (`MoEForCausalLM.config_fields`).

        Raises:
            ValueError: the `model_type` is not supported (the message lists the supported
                ones), the checkpoint is quantized, a RoPE type is not supported, or a field
                the model type needs is missing, null, of the wrong type (bools are not
                numbers) or out of range. The message names the field and `path`.
        """
        from moestream.models.registry import MODEL_REGISTRY  # the model files import this module

        where = f"config.json at {path}" if path else "config"
        if not isinstance(hf, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type not in MODEL_REGISTRY:
            raise ValueError(
                f"{where}: unsupported model_type '{model_type}'; supported: {', '.join(MODEL_REGISTRY)}"
            )
        quant = hf.get("quantization_config")
        if quant is not None:
            method = (quant.get("quant_method") or "unspecified") if isinstance(quant, dict) else quant
            block = quant.get("weight_block_size") if isinstance(quant, dict) else None
            raise ValueError(
                f"{where}: the checkpoint is quantized (quantization_config quant_method '{method}'"
                + (f", weight_block_size {block}" if block else "")
                + "); moestream loads float32 / bfloat16 / float16 weights only. Use a bf16 conversion of the "
                "checkpoint (for DeepSeek-V3 FP8, the bf16 weights its repository's fp8_cast_bf16.py writes)"
            )
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
        return ModelConfig(**common)


REQUIRED: Any = object()  # `default` of a field that must be present


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


class HFConfigFields:
    """Typed reads of an HF config dict: the one place its values are checked.

    Every error is a ValueError naming `where` (the config.json path) and the field:
    `names[key]` when given (a key taken from elsewhere in the file), else `prefix` + key.
    """

    def __init__(self, hf: dict[str, Any], where: str, model_name: str, prefix: str = "",
                 names: dict[str, str] | None = None) -> None:
        self.hf, self.where, self.model_name, self.prefix, self.names = hf, where, model_name, prefix, names or {}

    def name(self, key: str) -> str:
        """How errors name field `key`."""
        return self.names.get(key, self.prefix + key)

    def error(self, key: str, problem: str) -> ValueError:
        """The error for field `key`: '<where>: field '<name>' <problem>'."""
        return ValueError(f"{self.where}: field '{self.name(key)}' {problem}")

    def get(self, key: str, kind: type | tuple[type, ...], *alternatives: str, default: Any = REQUIRED) -> Any:
        """The value of the first of `key`, `*alternatives` that is set (not missing or null),
        checked to be of `kind`; `default` when none is set.

        Raises:
            ValueError: none is set and there is no default, or the value is not of `kind`.
        """
        for k in (key, *alternatives):
            value = self.hf.get(k)
            if value is None:
                continue
            kinds = kind if isinstance(kind, tuple) else (kind,)
            if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
                names = _KIND_NAMES.get(kind) or " or ".join(_KIND_NAMES.get(t, t.__name__) for t in kinds)
                raise self.error(k, f"must be {names}, got {type(value).__name__} {value!r}")
            return value
        if default is not REQUIRED:
            return default
        also = "".join(f" (or '{self.name(a)}')" for a in alternatives)
        state = "null" if key in self.hf else "missing"
        needed = f"a {self.model_name} config needs it"
        raise ValueError(f"{self.where}: field '{self.name(key)}'{also} is {state}; {needed}")

    def integer(self, key: str, *alternatives: str, default: Any = REQUIRED, minimum: int | None = None) -> Any:
        """An integer field (not a bool), at least `minimum` when given. See `get`."""
        value = self.get(key, int, *alternatives, default=default)
        if minimum is not None and is_int(value) and value < minimum:
            used = next(k for k in (key, *alternatives) if self.hf.get(k) is not None)
            raise self.error(used, f"must be at least {minimum}, got {value}")
        return value

    def number(self, key: str, default: Any = REQUIRED) -> Any:
        """A finite number (int or float, not a bool), as a float. See `get`."""
        value = self.get(key, (int, float), default=default)
        if is_number(value) or value is None:
            return value if value is None else float(value)
        raise self.error(key, f"must be a finite number, got {value!r}")

    def flag(self, key: str, default: bool) -> bool:
        """A JSON true/false field. See `get`."""
        return self.get(key, bool, default=default)

    def integers(self, key: str, default: Any = REQUIRED) -> Any:
        """A list of integers, as a tuple. See `get`."""
        value = self.get(key, list, default=default)
        if not isinstance(value, list):
            return value
        if not all(is_int(v) for v in value):
            raise self.error(key, f"must be a list of integers, got {value!r}")
        return tuple(value)


_KIND_NAMES: dict[type | tuple[type, ...], str] = {
    int: "an integer", (int, float): "a number", (int, list): "an integer or a list of integers",
    bool: "true or false", str: "a string", list: "a list", dict: "an object",
}


def sparse_layers(f: HFConfigFields, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Which layers are MoE, from `decoder_sparse_step` and `mlp_only_layers` (Qwen3-MoE, Qwen3-Next)."""
    step = f.integer("decoder_sparse_step", default=1, minimum=1)
    mlp_only = set(f.integers("mlp_only_layers", default=()))
    return tuple((i not in mlp_only) and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def rope_fields(f: HFConfigFields) -> HFConfigFields:
    """HF's v5 `rope_parameters` overlaid with v4 `rope_scaling`, as one `HFConfigFields`."""
    params = f.get("rope_parameters", dict, default={})
    scaling = f.get("rope_scaling", dict, default={})
    names = {k: f"{f.name('rope_scaling')}.{k}" for k in scaling}
    return HFConfigFields({**params, **scaling}, f.where, f.model_name, f.name("rope_parameters") + ".", names)


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


# Draft tokens per step at most: acceptance decays geometrically with the position, and on
# hybrid models each position keeps one linear-attention state per device slot.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings, as vLLM's `speculative_config`.

    Attributes:
        method: "ngram" (prompt lookup) or "draft_experts" (self-speculation: greedy drafts
            by the model itself with each MoE layer routed only to experts already on the
            device, so a draft never waits for an expert load; DraftExpert, arXiv 2607.24434).
            Or "mtp": the checkpoint's multi-token-prediction layer (`mtp.*` of the Qwen3-Next
            and Qwen3.5 hub checkpoints), chained for k drafts. The prompt_lookup fields apply
            to "ngram" only.
        num_speculative_tokens: draft tokens proposed per step (k), 1 to 16.
        prompt_lookup_min, prompt_lookup_max: n-gram sizes matched, longest first; when one
            is unset it takes the other's value, when both are unset both are 5 (vLLM's rule).
        adaptive: lower each request's draft length, down to 0, where its measured
            acceptance makes drafting slower than plain decode (`spec_decode.adaptive`), and
            raise it again when drafts start to match. False drafts
            `num_speculative_tokens` whenever the method has them, as vLLM.

    Raises:
        ValueError: an unknown method or a bad number.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.method not in ("ngram", "draft_experts", "mtp"):
            raise ValueError(f"unknown speculative method {self.method!r}; use 'ngram', 'draft_experts' or 'mtp'")
        if not is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {self.num_speculative_tokens!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, got "
                             f"{self.num_speculative_tokens}: each draft position costs verify compute (and, on hybrid "
                             "models, one state per slot), and acceptance falls with every position; 3-5 is typical")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        if not (is_int(lo) and is_int(hi) and 1 <= lo <= hi):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, d: "dict | SpeculativeConfig") -> "SpeculativeConfig":
        """From vLLM's dict form, e.g. {"method": "ngram", "num_speculative_tokens": 3}.

        Raises:
            ValueError: not a dict, a missing or unknown key, or a bad value.
        """
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict such as "
                             f'{{"method": "ngram", "num_speculative_tokens": 3}}, got {d!r}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in d:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**d)


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
        expert_policy: eviction policy of the device slots: "next_use" (default: predicted next
            use, the fewest misses on real routing traces), "lru", "lfu" or "activation".
        expert_prefetch: "gate" (next layer's router on this layer's input), "history"
            (co-activation statistics), "none", or "auto": gate on CUDA (loads into device
            slots), none on CPU. On CPU a prefetch is only page-cache read-ahead, measured no
            faster than none at 25% of experts (bench/results/expert_offload.md). Only used
            when experts are paged.
        expert_pin_profile: JSON file {"layer": [expert ids]} of experts kept resident.
        enable_elastic_memory: expert slots and KV blocks share one pool of expert_budget +
            KV cache bytes (`ElasticMemory`): when running requests need more KV blocks than
            are free, expert slots (free ones, then the policy's least valuable) become KV
            blocks instead of a preemption, and they come back once no request waits.
            Outputs are unchanged. Needs a paged expert budget. Off by default.
        record_routing: file to write the routing trace (request, token, layer, experts) to.
        max_resident_states: hybrid (linear-attention) models only: how many requests keep
            their conv/recurrent states on the device; the rest wait in host memory and are
            swapped back in before their next forward. None = max_num_seqs.
        mamba_ssm_cache_dtype: dtype of the linear-attention recurrent state (vLLM's name):
            "float32" (default), "bfloat16", "float16" or "auto" (the model dtype).
        generation_config: where default sampling parameters come from (vLLM's flag): "auto"
            (default) the model's generation_config.json, "vllm" the built-in defaults only,
            or a directory holding a generation_config.json.
        enable_prefix_caching: reuse the KV blocks of a cached prompt prefix instead of
            recomputing them (vLLM's default: on). Hybrid models also reuse linear-attention
            state checkpoints (see `KVCacheCoordinator`).
        state_checkpoint_interval: hybrid models with prefix caching: tokens between the
            state checkpoints taken in a prompt (a multiple of block_size; default 512). A
            hit recomputes at most this many tokens past the last checkpoint.
        max_state_checkpoints: hybrid models with prefix caching: state checkpoints kept on
            the device (each the size of one request's state); None = 8, or the number of
            state slots if that is smaller.
        state_checkpoint_host_bytes: hybrid models with prefix caching: bytes of host memory
            for checkpoints moved off the device (default 1 GiB; 0 = drop them instead).
        speculative_config: speculative decoding (`SpeculativeConfig`, or vLLM's dict form);
            None = off.
        limit_mm_per_prompt: multimodal checkpoints: most items per prompt by modality
            (vLLM's flag), e.g. {"image": 4, "video": 1}; defaults 16 images, 1 video.
        max_image_pixels: multimodal checkpoints: most pixels (width x height) of an input
            image or video frame, refused before its pixels are decoded (default 8192 x 8192).
        batch_invariant: a request's output, logits included, does not depend on which other
            requests share its steps (vLLM's batch-invariant mode, SGLang's deterministic
            inference): every matmul runs in calls of a fixed number of rows and decode
            attention runs one request at a time. Slower (docs/performance.md); off by
            default. Full-attention models only (Qwen3-MoE, Mixtral, GLM-4.5); refused for
            MLA and hybrid linear-attention models. A prompt's prefill chunks must be the
            same to compare: a prefix-cache hit computes the uncached tail as its own chunk,
            whose attention sums in another order (turn prefix caching off for that), and
            chunked prefill splits a long prompt by the step's other work. With speculative
            decoding it turns adaptive k off (the draft length would follow measured timings).
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
    expert_policy: str = "next_use"
    expert_prefetch: str = "auto"
    expert_pin_profile: str | None = None
    enable_elastic_memory: bool = False
    record_routing: str | None = None
    max_resident_states: int | None = None
    mamba_ssm_cache_dtype: str = "float32"
    generation_config: str = "auto"
    enable_prefix_caching: bool = True
    state_checkpoint_interval: int = 512
    max_state_checkpoints: int | None = None
    state_checkpoint_host_bytes: int = 1 << 30
    speculative_config: SpeculativeConfig | dict | None = None
    limit_mm_per_prompt: dict | None = None
    max_image_pixels: int = 8192 * 8192
    batch_invariant: bool = False

    @property
    def resolved_expert_prefetch(self) -> str:
        """`expert_prefetch` with "auto" resolved for the device."""
        if self.expert_prefetch != "auto":
            return self.expert_prefetch
        return "gate" if torch.device(self.device).type == "cuda" else "none"

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be a checkpoint directory path, got {self.model!r}")
        object.__setattr__(self, "model", resolve_model(self.model))  # "demo", "demo-hybrid": the built-in ones
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
        if not is_int(self.state_checkpoint_interval) or self.state_checkpoint_interval < 1 or (
            self.state_checkpoint_interval % self.block_size
        ):
            raise ValueError(f"state_checkpoint_interval must be a positive multiple of block_size {self.block_size}, "
                             f"got {self.state_checkpoint_interval!r}")
        if self.max_state_checkpoints is not None and (
            not is_int(self.max_state_checkpoints) or self.max_state_checkpoints < 0
        ):
            raise ValueError(f"max_state_checkpoints must be a non-negative integer, got {self.max_state_checkpoints!r}")
        if not is_int(self.state_checkpoint_host_bytes) or self.state_checkpoint_host_bytes < 0:
            raise ValueError(f"state_checkpoint_host_bytes must be a non-negative integer (bytes), "
                             f"got {self.state_checkpoint_host_bytes!r}")
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
            if self.batch_invariant is True and self.speculative_config.adaptive:
                # Adaptive k follows measured step times, which differ run to run: a fixed k
                # keeps the drafted (so the verified) tokens a function of the request alone.
                object.__setattr__(self, "speculative_config", replace(self.speculative_config, adaptive=False))
        if self.limit_mm_per_prompt is not None:
            lim = self.limit_mm_per_prompt
            if not isinstance(lim, dict) or any(k not in ("image", "video") or not is_int(v) or v < 0
                                                for k, v in lim.items()):
                raise ValueError(f"limit_mm_per_prompt must map 'image' and/or 'video' to non-negative integers, "
                                 f"e.g. {{\"image\": 4, \"video\": 1}}; got {lim!r}")
        if not is_int(self.max_image_pixels) or self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be a positive integer, got {self.max_image_pixels!r}")
        if not isinstance(self.enable_elastic_memory, bool):
            raise ValueError(f"enable_elastic_memory must be True or False, got {self.enable_elastic_memory!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}")
        if self.expert_policy not in POLICY_NAMES:
            raise ValueError(f"unknown expert policy '{self.expert_policy}'; use one of {', '.join(POLICY_NAMES)}")
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

