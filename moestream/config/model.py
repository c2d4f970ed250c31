"""Model architecture: `ModelConfig` and its parts (rope, router, MLA, vision), plain frozen
dataclasses with HF attribute names normalised. HF `config.json` is parsed in
`moestream.models.hf_config`, next to the model registry, where each model file reads its own
fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moestream.config.quantization import QuantizationConfig

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "yarn", "llama3")


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
class Mamba2Config:
    """The Mamba-2 (SSD) mixer of a hybrid model's linear layers (HF's `mamba_*` fields):
    `num_heads` H of `head_dim` P (inner size H*P), `state_size` N, `num_groups` G of B/C,
    a depthwise conv of `conv_kernel` taps (with `conv_bias`), `proj_bias` on in/out_proj,
    `chunk_size` (the SSD chunk of the reference kernels), `time_step_limit` (dt clamp)."""

    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    chunk_size: int
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (and of its state): x, B and C."""
        return self.num_heads * self.head_dim + 2 * self.num_groups * self.state_size


@dataclass(frozen=True)
class LoopConfig:
    """A looped MoE's layer layout (Foil's `loop-moe`): `num_head_layers` layers run once,
    then a stack of `num_layers_in_stack` (L) layers run `num_stacks` (R) times, then
    `num_tail_layers` layers run once. Decoder layer u counts the unrolled depth
    head + L * R + tail; each u has its own KV cache. The stack's router and experts (and its
    attention, unless `per_pass_attention`) are shared by the R passes. Head and tail layers
    have `outer_num_experts` experts each."""

    num_head_layers: int
    num_layers_in_stack: int
    num_stacks: int
    num_tail_layers: int
    per_pass_attention: bool
    outer_num_experts: int

    @property
    def unrolled_depth(self) -> int:
        """Decoder layers: head + L * R + tail."""
        return self.num_head_layers + self.num_layers_in_stack * self.num_stacks + self.num_tail_layers

    def locate(self, u: int) -> tuple[str, int, int]:
        """Decoder layer `u` as (block, pass, index in its block): ("head", 0, i),
        ("stack", r, l) or ("tail", 0, j).

        Raises:
            IndexError: `u` outside [0, unrolled_depth).
        """
        if not 0 <= u < self.unrolled_depth:
            raise IndexError(f"decoder layer {u} is outside the unrolled depth {self.unrolled_depth}")
        h, L = self.num_head_layers, self.num_layers_in_stack
        if u < h:
            return "head", 0, u
        if u < h + L * self.num_stacks:
            return "stack", (u - h) // L, (u - h) % L
        return "tail", 0, u - h - L * self.num_stacks


EXPERT_ACTIVATIONS: tuple[str, ...] = ("silu", "swigluoai", "relu2")


@dataclass(frozen=True)
class ExpertActivation:
    """The routed experts' gated activation over their gate_up projection's output [n, 2I].

    "silu": SwiGLU, silu(gate) * up, gate the first I outputs and up the last I.
    "swigluoai": gpt-oss's clamped SwiGLU (vLLM's `SwigluOAIAndMul`, transformers'
    `GptOssExperts._apply_gate`): outputs interleaved (gate 2j, up 2j + 1), gate clamped to
    at most `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).
    "relu2": Nemotron-H's ungated experts, relu(up)^2: the expert has no gate, its "gate_up"
    projection is the up projection alone ([I, H], output [n, I]).
    `bias`: each expert's projections have biases (gpt-oss: gate_up [2I] and down [H]).
    """

    name: str = "silu"
    alpha: float = 1.0
    limit: float = 0.0
    bias: bool = False

    @property
    def gated(self) -> bool:
        """Whether the experts have a gate projection (gate_up is [2I, H]) or not ([I, H])."""
        return self.name != "relu2"


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
    `bias`: the router's linear layer has a bias (gpt-oss).
    """

    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    float32: bool = False
    bias: bool = False

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
    `quantization`: the checkpoint's `quantization_config` (None: float weights).

    Granite-4.0-H: `mamba` (the Mamba-2 mixer of its linear layers), `embedding_multiplier`
    (scales the input embeddings), `residual_multiplier` (scales each block's output before
    the residual add), `attention_multiplier` (the softmax scale; None: head_dim ** -0.5),
    `logits_scaling` (logits are divided by it), `use_rope` False (no positional encoding).

    Sliding-window attention: `sliding_window` applies to every attention layer unless
    `layer_types` names some "sliding_attention" and others "full_attention" (gpt-oss);
    then only the former. `attention_sinks`: each attention head has a learned logit added
    to its softmax's denominator (gpt-oss `sinks`). `expert_activation`: the routed
    experts' gated activation and biases.

    Looped MoE (`loop`, Foil's loop-moe): `num_layers` is the unrolled depth and
    `moe_layers` marks the stack's layers of the first pass only, the decoder indices its
    experts are keyed by (see `LoopConfig`).
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
    quantization: QuantizationConfig | None = None
    attention_sinks: bool = False
    expert_activation: ExpertActivation = ExpertActivation()
    mamba: Mamba2Config | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    use_rope: bool = True
    loop: LoopConfig | None = None

    @property
    def is_hybrid(self) -> bool:
        """True when some layers are linear attention (they keep a state, not a KV cache)."""
        return "linear_attention" in self.layer_types

    @property
    def attention_layers(self) -> list[int]:
        """Decoder indices of attention layers, full or sliding-window (the ones with a KV cache)."""
        if not self.layer_types:
            return list(range(self.num_layers))
        return [i for i, t in enumerate(self.layer_types) if t in ("full_attention", "sliding_attention")]

    def layer_window(self, idx: int) -> int | None:
        """The sliding window of attention layer `idx` (tokens), or None for full attention."""
        if self.layer_types and self.layer_types[idx] != "sliding_attention":
            return None if "sliding_attention" in self.layer_types else self.sliding_window
        return self.sliding_window

    @property
    def linear_layers(self) -> list[int]:
        """Decoder indices of linear-attention (Gated DeltaNet) layers."""
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def gate_up_rows(self) -> int:
        """Rows of one routed expert's gate_up matrix: 2I (gate and up) or, for ungated
        experts (`expert_activation.gated` False, Nemotron-H), I (up alone)."""
        return (2 if self.expert_activation.gated else 1) * self.moe_intermediate_size

    @property
    def expert_numel(self) -> int:
        """Weights of one routed expert: gate_up plus down, (gate_up_rows + I) * H."""
        return (self.gate_up_rows + self.moe_intermediate_size) * self.hidden_size

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(heads, key dim, value dim) of one token's KV cache entry per layer. MLA caches
        one latent head of `kv_lora_rank + qk_rope_head_dim` and no separate value (the
        values are the latent's first `kv_lora_rank` dims)."""
        if self.mla is not None:
            return 1, self.mla.cache_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim
