"""Engine settings (`EngineConfig`), named as vLLM names them.

Each engine option is declared once, here, as a field with its type, default and help
(`option`); `moestream.engine.args` makes the command line's flags, `LLM(**kw)`'s filter
and the server's and Ray's engine settings from these declarations.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from moestream.config.speculative import SpeculativeConfig
from moestream.demo import resolve_model
from moestream.validation import is_int, is_number


def option(default: Any, help: str, *, group: str = "engine", parse: Callable[[str], Any] | None = None,
           choices: tuple[str, ...] | None = None, metavar: str | None = None, default_help: str | None = None,
           flag: bool = True) -> Any:
    """A field of `EngineConfig` declared with what its command-line flag needs: `help`, the
    argument `group` its flag is listed under, `parse` (str -> value; bool fields are
    --flag/--no-flag), `choices`, `metavar`, `default_help` (how the help states the
    default when `default` alone does not say it), and `flag` False for an option that has
    no command-line flag."""
    return field(default=default, metadata=dict(help=help, group=group, parse=parse, choices=choices,
                                                metavar=metavar, default_help=default_help, flag=flag))


def parse_budget(text: str) -> float | int:
    """'0.25' -> 0.25 (a fraction); '2000000000' -> 2000000000 (bytes).

    Raises:
        argparse.ArgumentTypeError: neither.
    """
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction like 0.25 or a number of bytes, got '{text}'") from None


def parse_json_object(text: str) -> dict:
    """A JSON object, e.g. '{"image": 4}'.

    Raises:
        argparse.ArgumentTypeError: not JSON, or not an object.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"image\": 4}}' or "
                                         f"'{{\"method\": \"ngram\"}}', got {text!r}")
    return value


MAX_THREADS = 1024
"""Upper bound of an explicit thread count: torch's OpenMP pool crashes (SIGSEGV) when asked
for ~10**5 threads and overflows at 2**31, and no CPU this engine runs on has more cores."""


def parse_threads(text: str) -> int | str:
    """`--threads`: a positive int up to `MAX_THREADS`, or 'auto'.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    if text == "auto":
        return text
    n = int(text) if text.lstrip("-").isdigit() else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got '{text}'")
    if n > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{n} is more than {MAX_THREADS} threads; give at most the cores this "
                                         "process may run on, or 'auto'")
    return n


_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
_HYBRID = "hybrid models (Qwen3-Next, Qwen3.5-MoE)"
_PAGING = "expert paging"
EXPERT_MODES = ("exact", "resident-fold", "eat", "exfold")  # opt-in approximate expert modes (docs/expert_modes.md)
_MODES = "approximate expert modes (opt-in; docs/expert_modes.md)"
_MM = "multimodal models (Qwen3.5-MoE with a vision tower)"


def check_request_expert_mode(requested: str | None, engine_mode: str) -> None:
    """A request's `expert_mode` against the engine's: None (the engine's), "exact" or the
    engine's own mode are served.

    Raises:
        ValueError: another approximate mode (the message says how to get it).
    """
    if requested not in (None, "exact", engine_mode):
        raise ValueError(f"expert_mode '{requested}' needs an engine started with --expert-mode {requested} "
                         f"(this one runs '{engine_mode}'); or ask for 'exact'")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings, named as vLLM names them; each field's `help` (`option`) says what
    it does, its units and its default. `model` is a Hugging Face checkpoint directory or a
    built-in model name ('demo', 'demo-hybrid', 'demo-looped').

    Raises:
        ValueError: a field of the wrong type or out of range (the message names it).
    """

    model: str = field(metadata=dict(
        help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer), or a built-in model: "
             "'demo' (the default, a small Qwen3-MoE trained on Python's standard library), 'demo-hybrid' (a "
             "small Qwen3.5-MoE hybrid with an MTP layer) or 'demo-looped' (a small looped MoE, loop-moe)", group="engine", parse=None, choices=None, metavar=None,
        default_help="demo", flag=True))
    dtype: str = option("auto", "weight and activation dtype; auto = the checkpoint's torch_dtype, except that a "
                        "bf16/fp16 checkpoint computes in float32 on a CPU without native bf16 (AVX2 only), where "
                        "that is faster", choices=_DTYPE_CHOICES)
    device: str = option("cpu", "torch device, e.g. cpu or cuda:0")
    max_model_len: int | None = option(None, "max tokens per sequence, prompt + output", parse=int,
                                       default_help="the model's max_position_embeddings")
    max_num_seqs: int = option(64, "max requests in one step", parse=int)
    max_num_batched_tokens: int = option(2048, "token budget of one step (prefill chunks + decodes); longer "
                                               "prompts are prefilled in chunks", parse=int)
    block_size: int = option(16, "tokens per KV cache block", parse=int)
    kv_cache_memory_bytes: int | None = option(None, "bytes for the KV cache", parse=int,
                                               default_help="enough for max-num-seqs full-length sequences, "
                                                            "at most 4 GiB")
    seed: int = option(0, "seed of the sampler's generator for requests without their own seed", parse=int,
                       flag=False)
    max_logprobs: int = option(20, "most logprobs a request may ask for per token", parse=int)
    enable_prefix_caching: bool = option(True, "reuse the KV cache (and, on hybrid models, linear-attention "
                                               "state checkpoints) of a prompt prefix seen before instead of "
                                               "recomputing it")
    disable_hybrid_kv_cache_manager: bool = option(False, "keep one KV cache group even when sliding-window and "
                                                          "full-attention layers are mixed (gpt-oss): sliding layers "
                                                          "then hold every block, as full ones do (vLLM's flag)")
    batch_invariant: bool = option(False, "a request's output and logits do not depend on the other requests in "
                                          "its batch (vLLM's batch-invariant mode): fixed-size matmul calls, decode "
                                          "attention per request; slower; full-attention models only (Qwen3-MoE, "
                                          "Mixtral, GLM-4.5, gpt-oss); with speculative decoding it fixes k")
    moe_runner_backend: str = option("auto", "routed experts' kernel (SGLang's flag): fused_cpu = one fused C++ "
                                             "call per MoE layer, compiled on first use (needs a C++ compiler), "
                                             "for decode-sized batches; torch = matmuls per expert; auto = "
                                             "fused_cpu on CPU in float32/bf16 when it compiles, else torch",
                                     choices=("auto", "torch", "fused_cpu"))
    attention_backend: str = option("auto", "decode attention (vLLM's flag): cpu_paged = one C++ call per layer "
                                            "reading the paged KV cache in place (needs a C++ compiler); "
                                            "torch_sdpa = blocks gathered, then scaled_dot_product_attention; "
                                            "auto = cpu_paged on CPU in float32/bf16 when it compiles",
                                    choices=("auto", "torch_sdpa", "cpu_paged"))
    gemm_backend: str = option("auto", "dense layers' kernels: cpu = moestream's C++ GEMM for linears of few rows "
                                       "on unpacked float32/bf16 weights (up to 8 rows; the lm_head up to 64), and "
                                       "RMSNorm (with the residual add) and rotary embedding in one C++ call each, "
                                       "compiled on first use; torch = F.linear (MKL / oneDNN) and PyTorch "
                                       "operators; auto = cpu on CPU in float32/bf16 when it compiles. With "
                                       "cpu, bf16 weights are laid out in oneDNN's VNNI layout for "
                                       "moestream's kernel at every row count (AVX512_BF16 CPUs; elsewhere "
                                       "they keep oneDNN), and the float32 lm_head in blocks of 16 outputs",
                               choices=("auto", "torch", "cpu"))
    enforce_eager: bool = option(False, "vLLM's flag: run every step's layers op by op from Python. By default a "
                                        "decode step's GQA + MoE layers run as one C++ call each (the same "
                                        "output, bit for bit) where gemm_backend and moe_runner_backend are the "
                                        "C++ ones and the experts are resident")
    speculative_config: SpeculativeConfig | dict | None = option(
        None, 'speculative decoding, as vLLM: e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
              '"prompt_lookup_max": 4}\'; methods ngram, draft_experts (drafts over resident experts only), mtp '
              '(the checkpoint\'s multi-token-prediction layer); "adaptive": false keeps k fixed',
        parse=parse_json_object, metavar="JSON", default_help="off")
    structured_outputs_config: dict | None = option(
        None, 'structured outputs, as vLLM: \'{"backend": "guidance", "disable_any_whitespace": true}\'; '
              'disable_any_whitespace makes every JSON constraint compact (a request can also ask for it); '
              'compile_timeout: seconds the server waits for a grammar to compile (default 10), then a 400',
        parse=parse_json_object, metavar="JSON", default_help="guidance, whitespace allowed")
    reasoning_parser: str | None = option(
        None, "the model's reasoning format, as vLLM: qwen3, deepseek_r1 (<think> opened by the template), glm45 "
              "(<think> written by the model), openai_gptoss (harmony's analysis channel); the server returns the "
              "thinking as reasoning_content, and constraints apply only after the reasoning ends",
        choices=("qwen3", "deepseek_r1", "glm45", "openai_gptoss"), default_help="none")
    threads: int | str | None = option(
        "auto", "torch intra-op threads of this process: N, or auto = on CPU the cores this process may use "
                "(affinity and cgroup quota; serve keeps one for its HTTP event loop), fewer under load, at "
                "least 1; torch's default on an accelerator. On shared cores give a number", parse=parse_threads,
        metavar="N|auto")
    generation_config: str = option(
        "auto", "where defaults for sampling fields a request leaves unset come from: auto = the model's "
                "generation_config.json (repetition_penalty, temperature, top_k, top_p, min_p, max_new_tokens), "
                "vllm = the built-in defaults only, or a directory holding a generation_config.json",
        group="sampling defaults", metavar="auto|vllm|DIR")
    expert_budget: float | int | None = option(
        None, "device memory for routed experts: a fraction in (0, 1] of their bytes (e.g. 0.25) or a number of "
              "bytes (e.g. 2000000000); the rest stay on disk / in host memory", group=_PAGING, parse=parse_budget,
        default_help="all resident")
    expert_host_cache_bytes: int = option(0, "bytes of host memory caching experts between disk and device",
                                          group=_PAGING, parse=int)
    expert_policy: str = option("next_use", "eviction policy of the expert slots: next_use (predicted next use; "
                                            "the fewest misses on real routing traces), lru, lfu or activation",
                                group=_PAGING)
    expert_prefetch: str = option("auto", "prefetch predicted experts: gate = next layer's router on this layer's "
                                          "input, history = co-activation statistics, auto = gate on CUDA and on "
                                          "CPU with --expert-direct-io on, else none (a CPU prefetch is then only "
                                          "page-cache read-ahead)",
                                  group=_PAGING, choices=("auto", "none", "gate", "history"))
    expert_direct_io: str = option("auto", "read expert misses from disk with O_DIRECT, past the kernel's page "
                                           "cache: on, off, or auto = on when the checkpoint's routed experts do not "
                                           "fit in the memory the page cache can use (MemAvailable, capped by the "
                                           "process's memory cgroup) beside the expert budget",
                                   group=_PAGING, choices=("auto", "on", "off"))
    expert_pin_profile: str | None = option(None, 'JSON file {"layer": [expert ids]} of hot experts kept resident',
                                            group=_PAGING, metavar="FILE")
    enable_elastic_memory: bool = option(False, "share one pool of expert-budget + KV-cache bytes between expert "
                                                "slots and KV blocks: expert slots become KV blocks when running "
                                                "requests need them instead of a preemption, and come back when no "
                                                "request waits (needs --expert-budget below 1)", group=_PAGING)
    expert_mode: str = option("exact", "opt-in approximate expert mode, the default of every request (a request's "
                                       "expert_mode 'exact' opts out): resident-fold = with paged experts, a token's "
                                       "routed expert that is not resident and weighs less than "
                                       "--resident-fold-threshold is folded onto its other experts instead of a "
                                       "read; eat = Expert Account Tracker, an adaptive number of experts per token; "
                                       "exfold = expert folding with calibrated projectors (`moestream calibrate`). "
                                       "docs/expert_modes.md gives each one's measured quality change",
                              group=_MODES, choices=EXPERT_MODES)
    resident_fold_threshold: float = option(0.25, "resident-fold: largest routing weight of a non-resident expert "
                                                  "that is folded (a token's top-1 expert never is)",
                                            group=_MODES, parse=float)
    eat_threshold: float = option(0.5, "eat: a non-top-1 pair is computed when its routing weight times its "
                                       "expert's account (relative to uniform) reaches this times the layer's "
                                       "average top-1 weight", group=_MODES, parse=float)
    eat_decay: float = option(0.99, "eat: decay of the per-layer expert accounts, per MoE layer call (in [0, 1))",
                              group=_MODES, parse=float)
    exfold_prefill_k: int | None = option(None, "exfold: experts a prompt token keeps (the rest are folded onto "
                                                "them)", group=_MODES, parse=int,
                                          default_help="half the model's top-k, at least 1")
    exfold_pool_size: int | None = option(None, "exfold: experts a decode step computes for the mode's rows per "
                                                "layer (the batch's other routed experts are folded onto them)",
                                          group=_MODES, parse=int, default_help="4 x the model's top-k")
    exfold_projectors: str | None = option(None, "ExFold projectors file (`moestream calibrate`): exfold's, and "
                                                 "given with resident-fold, its folds use them instead of "
                                                 "renormalising", group=_MODES, metavar="FILE",
                                           default_help="exfold: exfold_projectors.safetensors in the model "
                                                        "directory; resident-fold: none")
    record_routing: str | None = option(None, "record (request, token, layer, expert ids) of every routed token "
                                              "to FILE (.npz)", group=_PAGING, metavar="FILE")
    max_resident_states: int | None = option(None, "requests whose linear-attention states stay on the device; "
                                                   "the rest are swapped to host memory between their forwards",
                                             group=_HYBRID, parse=int, default_help="max-num-seqs")
    mamba_ssm_cache_dtype: str = option("float32", "dtype of the linear-attention recurrent state; auto = the "
                                                   "model dtype", group=_HYBRID, choices=_DTYPE_CHOICES)
    state_checkpoint_interval: int = option(512, "prefix caching: tokens between linear-attention state "
                                                 "checkpoints in a prompt, a multiple of --block-size; a hit "
                                                 "recomputes at most this many tokens", group=_HYBRID, parse=int,
                                            metavar="TOKENS")
    max_state_checkpoints: int | None = option(None, "prefix caching: state checkpoints kept on the device",
                                               group=_HYBRID, parse=int,
                                               default_help="8, or max-resident-states if fewer")
    state_checkpoint_host_bytes: int = option(1 << 30, "prefix caching: bytes of host memory for state checkpoints "
                                                       "moved off the device (0 drops them instead)",
                                              group=_HYBRID, parse=int)
    cartridge_dir: str | None = option(None, "directory where cartridge ids resolve (`<dir>/<id>.safetensors`, "
                                             "made by `moestream cartridge build`); requests name them in their "
                                             "`cartridges` field", group="cartridges", metavar="DIR",
                                       default_help="none: requests give paths (offline) only")
    cartridge_routing: str = option("always", "default of a request's cartridge_routing: always = attach the "
                                              "cartridges it names; auto = the cartridge's router attaches them only "
                                              "to a request about its document (docs/cartridges.md)",
                                    group="cartridges", choices=("always", "auto"))
    limit_mm_per_prompt: dict | None = option(None, "most items per prompt by modality, e.g. "
                                                    '\'{"image": 4, "video": 1}\'', group=_MM,
                                              parse=parse_json_object, metavar="JSON",
                                              default_help="16 images, 1 video")
    max_image_pixels: int = option(8192 * 8192, "larger input images or video frames (width x height) are refused "
                                                "before their pixels are decoded", group=_MM, parse=int,
                                   metavar="PIXELS", default_help="67108864, 8192 x 8192")

    def resolve_expert_prefetch(self, direct_io: bool) -> str:
        """`expert_prefetch` with "auto" resolved: gate on CUDA, and on CPU when misses are read
        with O_DIRECT (`direct_io`: a predicted expert is read into a slot while the step
        computes); none on CPU otherwise."""
        if self.expert_prefetch != "auto":
            return self.expert_prefetch
        return "gate" if self.device.startswith("cuda") or direct_io else "none"

    def __post_init__(self) -> None:
        import torch  # here, so that building the command line's parser does not import torch

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
        if self.moe_runner_backend not in ("auto", "torch", "fused_cpu"):
            raise ValueError(f"unknown moe_runner_backend '{self.moe_runner_backend}'; use auto, torch or fused_cpu")
        if self.gemm_backend not in ("auto", "torch", "cpu"):
            raise ValueError(f"unknown gemm_backend '{self.gemm_backend}'; use auto, torch or cpu")
        if self.attention_backend not in ("auto", "torch_sdpa", "cpu_paged"):
            raise ValueError(f"unknown attention_backend '{self.attention_backend}'; use auto, torch_sdpa or cpu_paged")
        if self.expert_prefetch not in ("auto", "none", "gate", "history"):
            raise ValueError(f"unknown expert prefetch mode '{self.expert_prefetch}'; use auto, none, gate or history")
        if self.expert_direct_io not in ("auto", "on", "off"):
            raise ValueError(f"unknown expert_direct_io '{self.expert_direct_io}'; use auto, on or off")
        if self.expert_mode not in EXPERT_MODES:
            raise ValueError(f"unknown expert_mode '{self.expert_mode}'; use one of {', '.join(EXPERT_MODES)}")
        if not (is_number(self.resident_fold_threshold) and 0.0 < self.resident_fold_threshold <= 1.0):
            raise ValueError(f"resident_fold_threshold must be in (0, 1], got {self.resident_fold_threshold!r}")
        if not (is_number(self.eat_threshold) and self.eat_threshold > 0.0):
            raise ValueError(f"eat_threshold must be a number above 0, got {self.eat_threshold!r}")
        if not (is_number(self.eat_decay) and 0.0 <= self.eat_decay < 1.0):
            raise ValueError(f"eat_decay must be in [0, 1), got {self.eat_decay!r}")
        for name in ("exfold_prefill_k", "exfold_pool_size"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name} must be a positive integer (experts), got {value!r}")
        if self.mamba_ssm_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"mamba_ssm_cache_dtype must be auto, float32, bfloat16 or float16; got {self.mamba_ssm_cache_dtype!r}"
            )
        if not is_int(self.state_checkpoint_interval) or self.state_checkpoint_interval < 1:
            # the multiple-of-block_size rule applies to hybrid models only: build_engine checks it
            raise ValueError(f"state_checkpoint_interval must be a positive integer (tokens), "
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
        so = self.structured_outputs_config
        timeout = so.get("compile_timeout", 1.0) if isinstance(so, dict) else 1.0
        if so is not None and not (
                isinstance(so, dict) and set(so) <= {"backend", "disable_any_whitespace", "compile_timeout"}
                and so.get("backend", "guidance") in ("auto", "guidance")
                and isinstance(so.get("disable_any_whitespace", False), bool)
                and isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
            raise ValueError(f"structured_outputs_config takes backend ('auto' or 'guidance'), "
                             f"disable_any_whitespace (true/false) and compile_timeout (seconds > 0); got {so!r}")
        if self.limit_mm_per_prompt is not None:
            lim = self.limit_mm_per_prompt
            if not isinstance(lim, dict) or any(k not in ("image", "video") or not is_int(v) or v < 0
                                                for k, v in lim.items()):
                raise ValueError(f"limit_mm_per_prompt must map 'image' and/or 'video' to non-negative integers, "
                                 f"e.g. {{\"image\": 4, \"video\": 1}}; got {lim!r}")
        if self.cartridge_routing not in ("always", "auto"):
            raise ValueError(f"cartridge_routing must be always or auto, got {self.cartridge_routing!r}")
        if self.cartridge_dir is not None and not os.path.isdir(self.cartridge_dir):
            raise ValueError(f"cartridge_dir '{self.cartridge_dir}' is not a directory; create it or point "
                             "--cartridge-dir at the directory holding the cartridges")
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
        if not isinstance(self.expert_policy, str) or not self.expert_policy:
            raise ValueError(f"expert_policy must be a policy name, got {self.expert_policy!r}")
        if self.threads is not None and self.threads != "auto" and (not is_int(self.threads) or self.threads < 1):
            raise ValueError(f"threads must be a positive integer or 'auto' (None: torch's own setting), "
                             f"got {self.threads!r}")
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
