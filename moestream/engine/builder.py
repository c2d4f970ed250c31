"""`EngineConfig` -> the engine's parts: model config, tokenizer, expert store, model, KV
cache and state pools, coordinator, scheduler, runner, sampler, input and output
processors, and the speculator. Every size is logged here, once, at start-up."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from moestream.config import EngineConfig, ModelConfig, SpeculativeConfig, resolve_dtype
from moestream.engine.args import check_engine_config
from moestream.engine.elastic_memory import ElasticMemory, PageGeometry
from moestream.engine.input_processor import InputProcessor
from moestream.kernels.fused_moe import ACT_CODES
from moestream.engine.kv_cache import KVCacheManager, kv_block_bytes, kv_cache_groups, num_kv_blocks
from moestream.cartridges.format import model_fingerprint
from moestream.engine.cartridge_cache import CartridgeCache, CartridgeSpec
from moestream.engine.kv_cache_coordinator import KVCacheCoordinator
from moestream.engine.model_runner import ModelRunner
from moestream.engine.output_processor import OutputProcessor
from moestream.engine.scheduler import Scheduler
from moestream.engine.state_checkpoints import StateCheckpointPool
from moestream.engine.state_pool import StatePool
from moestream.experts.planner import ExpertPlan, plan_experts
from moestream.experts.policy import make_policy
from moestream.experts.resident import ResidentExpertStore
from moestream.experts.eat import ExpertAccountTracker
from moestream.experts.exfold import ExFold
from moestream.experts.expert_mode import ExpertMode
from moestream.experts.fold_projectors import FoldProjectors
from moestream.experts.resident_fold import ResidentFold
from moestream.experts.store import PagedExpertStore, load_pin_profile
from moestream.host_memory import page_cache_room
from moestream.experts.trace import RoutingRecorder
from moestream.quantization.registry import make_quant_method
from moestream.reasoning import get_reasoning_parser
from moestream.generation_config import default_sampling_fields
from moestream.kernels.build import load_cpu_kernels
from moestream.layers.attention_backend import TorchAttentionBackend
from moestream.layers.moe import SparseMoE
from moestream.layers.linear import (BATCH_INVARIANT_ROW_TILE, cpu_has_native_bf16, process_weights_after_loading,
                                     set_cpu_gemm)
from moestream.layers.norm import set_cpu_norm
from moestream.layers.rotary import set_cpu_rotary
from moestream.loader import (
    CheckpointReader,
    build_model,
    expert_locations,
    load_packed_experts,
    load_resident_experts,
    load_tokenizer,
    packed_experts,
)
from moestream.models.hf_config import model_config_from_hf
from moestream.models.registry import get_model_class
from moestream.multimodal.processor import MultiModalProcessor
from moestream.multimodal.vision import load_vision_encoder
from moestream.sampler import Sampler
from moestream.spec_decode.mtp import load_mtp
from moestream.spec_decode.speculator import Speculator
from moestream.structured_output.backend import GrammarBackend
from moestream.structured_output.guidance import GuidanceBackend
from moestream.structured_output.reasoning_gate import ReasoningGatedBackend

logger = logging.getLogger(__name__)

# A state checkpoint is a whole request state (about 74 MiB on Qwen3-Next-80B): few on the
# device by default, the rest in host memory (state_checkpoint_host_bytes).
_DEFAULT_DEVICE_CHECKPOINTS = 8


@dataclass
class EngineParts:
    """What `build_engine` makes. Sizes: `max_model_len` in tokens, KV figures in bytes."""

    model_config: ModelConfig
    tokenizer: object  # transformers.PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    default_sampling_fields: dict
    max_model_len: int
    mm_processor: MultiModalProcessor | None
    input_processor: InputProcessor
    expert_plan: ExpertPlan
    expert_store: ResidentExpertStore | PagedExpertStore
    expert_mode: ExpertMode | None
    elastic_memory: ElasticMemory | None
    recorder: RoutingRecorder | None
    state_pool: StatePool | None
    coordinator: KVCacheCoordinator
    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    grammar_backend: GrammarBackend
    eos_token_ids: frozenset[int]
    output_processor: OutputProcessor
    speculator: Speculator | None
    kv_cache_block_bytes: int
    kv_cache_bytes_per_token: int
    kv_cache_mha_bytes_per_token: int | None


def _make_cartridge_cache(config: EngineConfig, mcfg: ModelConfig, kv_cache: KVCacheManager, num_groups: int,
                          state_pool: StatePool | None, dtype: torch.dtype,
                          sc: SpeculativeConfig | None) -> CartridgeCache:
    """The engine's `CartridgeCache`, or one that refuses every cartridge with the reason the
    model or configuration cannot serve them (`unsupported`)."""
    reason = None
    if num_groups > 1 or kv_cache.window is not None:
        reason = "a model with sliding-window attention layers (gpt-oss)"
    elif sc is not None and sc.method == "mtp":
        reason = "speculative method mtp (its layer has no cartridge entries)"
    elif not mcfg.attention_layers:
        reason = "a model without attention layers"
    states = () if state_pool is None else tuple((tuple(t.shape), t.dtype) for t in state_pool.read_row(0))
    spec = CartridgeSpec(model_fingerprint(config.model), len(mcfg.attention_layers), mcfg.kv_cache_dims, states)
    return CartridgeCache(spec, kv_cache.pool, config.block_size, config.cartridge_dir, dtype,
                          config.cartridge_routing, reason)


def auto_compute_dtype(checkpoint_dtype: torch.dtype, device: torch.device, native_bf16: bool) -> torch.dtype:
    """The dtype `dtype="auto"` computes in: the checkpoint's, except bfloat16 / float16 on a
    CPU without native bf16 matrix instructions (`cpu_has_native_bf16`, e.g. AVX2 only),
    where torch's low-precision kernels run 2.5-4.7x slower than float32: there it is
    float32 (weights take twice the memory; ask for dtype="bfloat16" to keep them small).
    The choice is logged."""
    if device.type == "cpu" and checkpoint_dtype in (torch.bfloat16, torch.float16) and not native_bf16:
        logger.info("dtype auto: the checkpoint is %s, but this CPU has no native bf16/fp16 matrix instructions "
                    "(AVX512-BF16 or AMX), where float32 is faster: computing in float32 (pass dtype=%r to keep %s)",
                    str(checkpoint_dtype).removeprefix("torch."), str(checkpoint_dtype).removeprefix("torch."),
                    str(checkpoint_dtype).removeprefix("torch."))
        return torch.float32
    return checkpoint_dtype


def build_engine(config: EngineConfig) -> EngineParts:
    """Make every part of an engine from `config`.

    Raises:
        ValueError: a bad config, a missing/unreadable checkpoint or tokenizer, or a KV
            budget too small for one max_model_len sequence.
    """
    check_engine_config(config)
    mcfg = model_config_from_hf(config.model)
    if config.batch_invariant and (mcfg.mla is not None or mcfg.is_hybrid):  # before any weight loads
        name = get_model_class(mcfg.model_type).display_name or mcfg.model_type
        what = "multi-head latent attention" if mcfg.mla is not None else "linear-attention layers"
        raise ValueError(f"batch_invariant is not supported for {name} ({what}: not covered); turn "
                         "batch_invariant off")
    if mcfg.is_hybrid and config.state_checkpoint_interval % config.block_size:
        raise ValueError(f"state_checkpoint_interval must be a positive multiple of block_size {config.block_size} "
                         f"for a model with linear-attention layers, got {config.state_checkpoint_interval}; "
                         "set --state-checkpoint-interval to a multiple of --block-size")
    tokenizer = load_tokenizer(config.model)
    device = torch.device(config.device)
    dtype = resolve_dtype(config.dtype, mcfg.torch_dtype)
    if config.dtype == "auto":
        dtype = auto_compute_dtype(dtype, device, cpu_has_native_bf16())
    defaults = default_sampling_fields(config.generation_config, config.model)
    if defaults:
        logger.info("default sampling parameters from the model's generation config: %s (they apply where a "
                    "request leaves a field unset; generation_config='vllm' turns them off)", defaults)
    max_model_len = config.max_model_len or mcfg.max_position_embeddings
    if max_model_len > mcfg.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                         f"{mcfg.max_position_embeddings}; lower max_model_len")
    mm_processor = None
    if mcfg.multimodal is not None:
        mm_processor = MultiModalProcessor(config.model, mcfg.multimodal, config.limit_mm_per_prompt,
                                           config.max_image_pixels)

    # experts and weights
    sc = config.speculative_config
    reader = CheckpointReader(config.model)
    recorder = RoutingRecorder() if config.record_routing else None
    pinned = load_pin_profile(config.expert_pin_profile, mcfg) if config.expert_pin_profile else []
    moe_layers = [i for i, m in enumerate(mcfg.moe_layers) if m]
    method = make_quant_method(mcfg.quantization) if mcfg.quantization is not None else None
    packed = packed_experts(mcfg, reader, method)  # (layout, locations) when the experts are stored quantized
    elem = torch.tensor([], dtype=dtype).element_size()
    plan = plan_experts(config.expert_budget, len(moe_layers) * mcfg.num_experts,
                        packed[0].nbytes if packed else mcfg.expert_numel * elem,
                        mcfg.num_experts_per_tok, len(pinned), config.expert_host_cache_bytes)
    if config.enable_elastic_memory and not mcfg.expert_activation.gated:
        raise ValueError(f"enable_elastic_memory does not support ungated experts ({mcfg.model_type}) yet; turn it off")
    elastic = _make_elastic_memory(config, mcfg, plan, max_model_len, dtype, device) if (
        config.enable_elastic_memory) else None
    store: ResidentExpertStore | PagedExpertStore
    if plan.resident:
        store = ResidentExpertStore(recorder)
    else:
        locations = packed[1] if packed else expert_locations(mcfg, reader)
        direct_io = use_direct_io(config.expert_direct_io,
                                  sum(loc.nbytes for locs in locations.values() for loc in locs if loc is not None),
                                  plan.num_slots * plan.expert_bytes, page_cache_room())
        # past the page cache (O_DIRECT), a predicted expert can only be read into a slot
        prefetch_target = "slots" if device.type == "cuda" or direct_io else "page_cache"
        store = PagedExpertStore(
            locations, mcfg.num_layers, moe_layers, mcfg.num_experts,
            mcfg.moe_intermediate_size, mcfg.hidden_size, dtype, device, plan.num_slots,
            plan.host_cache_experts, make_policy(config.expert_policy), pinned, config.resolve_expert_prefetch(direct_io),
            prefetch_target, mcfg.num_experts_per_tok, recorder,
            compute_in_place=device.type == "cpu",
            slot_views=elastic.expert_views() if elastic is not None else None,
            layout=packed[0] if packed else None,
            gated=mcfg.expert_activation.gated,
            direct_io=direct_io,
        )
    paged_attention = use_cpu_kernel(config.attention_backend, "attention_backend", "cpu_paged", device, dtype,
                                     config.batch_invariant)
    backend = TorchAttentionBackend(config.batch_invariant, paged_attention)
    model = build_model(mcfg, reader, dtype, device, backend, store, method)
    if config.batch_invariant:
        model.set_row_tile(BATCH_INVARIANT_ROW_TILE)
    if config.moe_runner_backend == "fused_cpu" and mcfg.expert_activation.name not in ACT_CODES:
        raise ValueError(f"moe_runner_backend fused_cpu does not run {mcfg.expert_activation.name} experts "
                         f"({mcfg.model_type}) yet; use auto")
    fused_moe = use_cpu_kernel(config.moe_runner_backend, "moe_runner_backend", "fused_cpu", device, dtype,
                               config.batch_invariant)
    model.set_fused_moe(fused_moe)
    cpu_gemm = use_cpu_kernel(config.gemm_backend, "gemm_backend", "cpu", device, dtype, config.batch_invariant)
    expert_mode = _make_expert_mode(config, store, mcfg, model)
    model.set_routing_modifier(expert_mode)
    if plan.resident and packed:
        load_packed_experts(packed[0], packed[1], mcfg.num_experts, device, store)
    elif plan.resident:
        load_resident_experts(mcfg, reader, dtype, device, store)
    vision = load_vision_encoder(mcfg.multimodal, reader, dtype, device) if mcfg.multimodal is not None else None
    mtp = load_mtp(mcfg, reader, dtype, device, TorchAttentionBackend(), method) if (
        sc is not None and sc.method == "mtp") else None
    for module in (model, mtp):
        if module is not None:
            set_cpu_gemm(module, cpu_gemm)  # first: it lays the lm_head out for its own kernel
            set_cpu_norm(module, cpu_gemm)
            set_cpu_rotary(module, cpu_gemm)
    model.set_cpu_decode_layer(cpu_gemm and fused_moe and not config.enforce_eager)
    packed = process_weights_after_loading(model) + (process_weights_after_loading(mtp) if mtp is not None else 0)
    if packed:
        logger.info("%d dense weights prepacked for oneDNN's bf16 matmul", packed)

    # caches
    bs = config.block_size
    windows = [mcfg.layer_window(i) for i in mcfg.attention_layers]
    groups = kv_cache_groups([None] * len(windows) if config.disable_hybrid_kv_cache_manager else windows)
    if len(groups) > 1 and elastic is not None:
        raise ValueError("enable_elastic_memory does not support a model with several KV cache groups (sliding-window "
                         "and full-attention layers, gpt-oss) yet; turn it off")
    # layer k of each group uses KV tensor k; the MTP layer has a KV cache too
    num_kv_layers = max(len(g.layers) for g in groups) + (mtp is not None)
    heads, k_dim, v_dim = mcfg.kv_cache_dims
    block_bytes = kv_block_bytes(num_kv_layers, bs, heads, k_dim, dtype, v_dim)
    mha_per_token = _log_kv_bytes(mcfg, len(mcfg.attention_layers) + (mtp is not None), block_bytes // bs, dtype)
    num_blocks = num_kv_blocks(config.kv_cache_memory_bytes, block_bytes, bs, max_model_len, config.max_num_seqs,
                               len(groups))
    if elastic is not None:
        num_blocks = elastic.num_blocks
    kv_cache = KVCacheManager(num_blocks, bs, config.enable_prefix_caching,
                              offline_blocks=elastic.offline_blocks() if elastic is not None else (),
                              window=groups[0].window)
    other_groups = [KVCacheManager(0, bs, config.enable_prefix_caching, pool=kv_cache.pool, window=g.window, group=i)
                    for i, g in enumerate(groups[1:], start=1)]
    layer_tensor = [0] * len(mcfg.attention_layers)
    for g in groups:
        for k, a in enumerate(g.layers):
            layer_tensor[a] = k
    if elastic is not None:
        elastic.bind(store, kv_cache)
    state_pool = _make_state_pool(config, mcfg, dtype, device) if mcfg.is_hybrid else None
    checkpoints = None
    if state_pool is not None and config.enable_prefix_caching:
        checkpoints = StateCheckpointPool(state_pool, config.state_checkpoint_host_bytes)
    cartridges = _make_cartridge_cache(config, mcfg, kv_cache, len(groups), state_pool, dtype, sc)
    coordinator = KVCacheCoordinator(kv_cache, state_pool, checkpoints, config.state_checkpoint_interval, elastic,
                                     other_groups, cartridges)
    input_processor = InputProcessor(tokenizer, mcfg.vocab_size, max_model_len, mm_processor, cartridges)
    scheduler = Scheduler(coordinator, config.max_num_seqs, config.max_num_batched_tokens)
    runner = ModelRunner(model, num_blocks, bs, dtype, device, state_pool, recorder, mtp, vision,
                         elastic.kv_caches() if elastic is not None else None, layer_tensor)
    runner.expert_mode = expert_mode
    cartridges.kv_caches = runner.kv_caches
    eos = set(mcfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    eos_token_ids = frozenset(eos)
    speculator = Speculator(sc, runner, coordinator, scheduler, max_model_len) if sc is not None else None

    _log_sizes(config, mcfg, model, plan, kv_cache, block_bytes, dtype, max_model_len, elastic, state_pool,
               checkpoints, packed is not None, getattr(store, "prefetch_target", "slots"),
               getattr(store, "prefetch_mode", "none"))
    return EngineParts(
        model_config=mcfg, tokenizer=tokenizer, device=device, dtype=dtype, default_sampling_fields=defaults,
        max_model_len=max_model_len, mm_processor=mm_processor, input_processor=input_processor, expert_plan=plan,
        expert_store=store, expert_mode=expert_mode, elastic_memory=elastic, recorder=recorder, state_pool=state_pool,
        coordinator=coordinator, scheduler=scheduler, runner=runner,
        sampler=Sampler(config.seed, device, argmax_kernel=fused_moe or paged_attention),
        grammar_backend=make_grammar_backend(config, tokenizer, mcfg.vocab_size),
        eos_token_ids=eos_token_ids, output_processor=OutputProcessor(tokenizer, eos_token_ids, max_model_len),
        speculator=speculator, kv_cache_block_bytes=block_bytes, kv_cache_bytes_per_token=block_bytes // bs,
        kv_cache_mha_bytes_per_token=mha_per_token,
    )


def _make_expert_mode(config: EngineConfig, store: ResidentExpertStore | PagedExpertStore, mcfg: ModelConfig,
                      model: torch.nn.Module) -> ExpertMode | None:
    """The engine's approximate expert mode, or None (exact). resident-fold needs paged
    experts: with every expert resident nothing is ever folded, so it is off (and logged).

    Raises:
        FileNotFoundError: exfold without a projector file.
        ValueError: a projector file of another model.
    """
    if config.expert_mode == "exact":
        return None
    layers = sorted({m.layer_idx for m in model.modules() if isinstance(m, SparseMoE)})
    path = config.exfold_projectors or FoldProjectors.path_for(str(config.model))
    k = mcfg.num_experts_per_tok
    note = "approximate; requests may opt out with expert_mode 'exact'"
    if config.expert_mode == "eat":
        logger.info("expert_mode eat: threshold %g, decay %g (%s)", config.eat_threshold, config.eat_decay, note)
        return ExpertAccountTracker(config.eat_threshold, config.eat_decay)
    if config.expert_mode == "exfold":
        projectors = FoldProjectors.load(path, layers, mcfg.num_experts)
        prefill_k = config.exfold_prefill_k or max(1, k // 2)
        pool = config.exfold_pool_size or 4 * k
        logger.info("expert_mode exfold: prompt tokens keep %d of %d experts, decode pool %d, projectors %s (%s)",
                    prefill_k, k, pool, path, note)
        return ExFold(projectors, prefill_k, pool)
    if not isinstance(store, PagedExpertStore):
        logger.warning("expert_mode resident-fold: every expert is resident (no expert_budget below 1), so nothing "
                       "is folded; running exact")
        return None
    projectors = FoldProjectors.load(path, layers, mcfg.num_experts) if config.exfold_projectors else None
    logger.info("expert_mode resident-fold: non-resident experts under routing weight %g are folded %s (%s)",
                config.resident_fold_threshold,
                f"with the projectors of {path}" if projectors else "by renormalising the rest", note)
    return ResidentFold(store, config.resident_fold_threshold, projectors)


def make_grammar_backend(config: EngineConfig, tokenizer: Any, vocab_size: int) -> GrammarBackend:
    """The structured-outputs backend (llguidance); with a `reasoning_parser`, its matchers wait
    for the end of the reasoning."""
    backend: GrammarBackend = GuidanceBackend(tokenizer, vocab_size, bool(
        (config.structured_outputs_config or {}).get("disable_any_whitespace", False)))
    if config.reasoning_parser is not None:
        backend = ReasoningGatedBackend(backend, tokenizer, get_reasoning_parser(config.reasoning_parser))
    return backend


def use_direct_io(choice: str, on_disk_bytes: int, budget_bytes: int, room: int | None) -> bool:
    """Resolve `expert_direct_io`: whether disk misses are read with O_DIRECT. "on" / "off" as
    given; "auto": on when the routed experts' bytes on disk (`on_disk_bytes`) exceed the memory
    the page cache could hold beside the expert slots (`room`, from `page_cache_room()`, less
    `budget_bytes`; None: unknown, so off), so that a buffered read would only pass through a
    cache that thrashes. Logs the choice."""
    if choice != "auto":
        return choice == "on"
    direct = room is not None and on_disk_bytes > room - budget_bytes
    logger.info("expert misses read %s: routed experts %.1f GiB on disk, page cache room %s beside %.1f GiB of "
                "slots (expert_direct_io auto)", "with O_DIRECT" if direct else "through the page cache",
                on_disk_bytes / 2**30, "unknown" if room is None else f"{room / 2**30:.1f} GiB", budget_bytes / 2**30)
    return direct


def use_cpu_kernel(choice: str, flag: str, kernel: str, device: torch.device, dtype: torch.dtype,
                   batch_invariant: bool) -> bool:
    """Resolve `moe_runner_backend` / `attention_backend` / `gemm_backend` (`flag`): whether that
    part runs through its CPU kernel (`kernel`: "fused_cpu", "cpu_paged", "cpu"), compiling the kernels on first
    use. "auto": on CPU, in float32 or bf16, outside the batch-invariant mode, when the
    kernels compile; the other choice ("torch", "torch_sdpa") never.

    Raises:
        ValueError: the kernel asked for off CPU, in another dtype, with batch_invariant, or
            without a working compiler.
    """
    supported = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if choice not in ("auto", kernel) or (choice == "auto" and (not supported or batch_invariant)):
        return False
    if choice == kernel and not supported:
        raise ValueError(f"{flag} {kernel} runs on CPU in float32 or bfloat16, not {device.type} / {dtype}; use "
                         "auto")
    if choice == kernel and batch_invariant:
        raise ValueError(f"{flag} {kernel} is not batch-invariant across batch sizes; leave it on auto with "
                         "batch_invariant")
    if load_cpu_kernels():
        return True
    if choice == kernel:
        raise ValueError(f"{flag} {kernel}: the CPU kernels did not build (see the warning above); install a C++ "
                         "compiler (g++) or use auto")
    return False


def _make_elastic_memory(config: EngineConfig, mcfg: ModelConfig, plan: ExpertPlan, max_model_len: int,
                         dtype: torch.dtype, device: torch.device) -> ElasticMemory:
    """One page pool for expert slots and KV blocks (`enable_elastic_memory`).

    Raises:
        ValueError: the experts are all resident, or the model has no attention layers.
    """
    if mcfg.quantization is not None:
        raise ValueError("enable_elastic_memory does not hold quantized (packed) experts yet; turn it off for "
                         "quantized checkpoints")
    if plan.resident:
        raise ValueError("enable_elastic_memory shares memory between paged experts and the KV cache; give "
                         "an expert_budget below the routed experts' size (e.g. 0.5)")
    sc = config.speculative_config
    num_kv_layers = len(mcfg.attention_layers) + (sc is not None and sc.method == "mtp")
    if num_kv_layers == 0:
        raise ValueError("enable_elastic_memory needs a model with attention layers")
    geometry = PageGeometry(mcfg.moe_intermediate_size, mcfg.hidden_size, num_kv_layers, config.block_size,
                            *mcfg.kv_cache_dims)
    elem = torch.tensor([], dtype=dtype).element_size()
    kv_blocks = num_kv_blocks(config.kv_cache_memory_bytes, geometry.block_elems * elem, config.block_size,
                              max_model_len, config.max_num_seqs)
    return ElasticMemory(geometry, plan.num_slots, -(-kv_blocks // geometry.blocks_per_page), dtype, device)


def _make_state_pool(cfg: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> StatePool:
    """Device state slots for `max_resident_states` requests (default max_num_seqs), of the
    state tensors the model's recurrent mixer declares."""
    mixer = get_model_class(mcfg.model_type).recurrent_mixer
    if mixer is None:
        raise ValueError(f"model type '{mcfg.model_type}' has linear-attention layers but no recurrent mixer")
    state_dtype = dtype if cfg.mamba_ssm_cache_dtype == "auto" else resolve_dtype(cfg.mamba_ssm_cache_dtype, None)
    return StatePool(
        len(mcfg.linear_layers),
        mixer.state_specs(mcfg, dtype, state_dtype),
        cfg.max_resident_states or cfg.max_num_seqs,
        device,
        num_checkpoint_rows=0 if not cfg.enable_prefix_caching else (
            cfg.max_state_checkpoints if cfg.max_state_checkpoints is not None
            else min(_DEFAULT_DEVICE_CHECKPOINTS, cfg.max_resident_states or cfg.max_num_seqs)),
        num_spec_rows=cfg.speculative_config.num_speculative_tokens if cfg.speculative_config else 0,
    )


def _log_kv_bytes(mcfg: ModelConfig, num_kv_layers: int, per_token: int, dtype: torch.dtype) -> int | None:
    """Log the KV cache's bytes per token; for MLA, against the expanded per-head keys and
    values an MHA cache would hold, which it returns (None for other models)."""
    if mcfg.mla is None:
        logger.info("KV cache: %d bytes per token (%d layers)", per_token, num_kv_layers)
        return None
    m, elem = mcfg.mla, torch.tensor([], dtype=dtype).element_size()
    mha = num_kv_layers * mcfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * elem
    logger.info("KV cache (MLA latent, kv_lora_rank %d + qk_rope_head_dim %d): %d bytes per token (%d layers); "
                "expanded MHA keys and values would take %d (%.1fx)", m.kv_lora_rank, m.qk_rope_head_dim,
                per_token, num_kv_layers, mha, mha / per_token)
    return mha


def _log_sizes(config: EngineConfig, mcfg: ModelConfig, model: torch.nn.Module, plan: ExpertPlan,
               kv_cache: KVCacheManager, block_bytes: int, dtype: torch.dtype,
               max_model_len: int, elastic: ElasticMemory | None, pool: StatePool | None,
               checkpoints: StateCheckpointPool | None, packed: bool, prefetch_target: str, prefetch: str) -> None:
    """Log every start-up figure: dense and expert bytes, expert slots, KV blocks, elastic
    pages, state slots and checkpoints."""
    bs = config.block_size
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info(
        "model %s (%s, %s): dense weights %.1f MiB resident; routed experts %.1f MiB in all, %s; "
        "KV cache %d blocks x %d tokens (%d bytes each, %.1f MiB); max_model_len %d",
        config.model, mcfg.model_type, dtype, dense_bytes / 2**20, plan.total_bytes / 2**20,
        "all resident" if plan.resident else (
            f"{plan.num_slots} device slots of {plan.expert_bytes} bytes ({plan.num_slots * plan.expert_bytes / 2**20:.1f} "
            f"MiB), host cache {plan.host_cache_experts} experts, policy {config.expert_policy}, "
            f"prefetch {prefetch}"
            f"{' into slots' if prefetch_target == 'slots' else ' as page-cache read-ahead'}"),
        kv_cache.num_blocks, bs, block_bytes, kv_cache.num_blocks * block_bytes / 2**20, max_model_len,
    )
    if elastic is not None:
        st = elastic.stats()
        logger.info("elastic memory: %d pages of %d bytes (one expert slot or %d KV blocks each), %d start as "
                    "expert slots and %d as KV blocks", st["num_pages"], st["page_bytes"], st["blocks_per_page"],
                    st["expert_pages"], st["kv_pages"])
    if mcfg.quantization is not None:
        bf16 = 3 * mcfg.moe_intermediate_size * mcfg.hidden_size * 2
        logger.info("quantized checkpoint (%s): %s; %s experts fit in %.1f MiB of device memory, against %d in bf16 "
                    "(%.2fx); dense quantized weights dequantized to %s at load",
                    mcfg.quantization.describe(),
                    f"routed experts kept packed, {plan.expert_bytes} bytes each (bf16: {bf16})" if packed
                    else "routed experts not quantized", plan.num_slots, plan.budget_bytes / 2**20,
                    plan.budget_bytes // bf16, bf16 / plan.expert_bytes, str(dtype).removeprefix("torch."))
    if pool is None:
        return
    logger.info(
        "hybrid model: KV cache for %d of %d layers (full attention); linear-attention state %.2f MiB per "
        "request (%d layers, %s, with %d speculative rows); %d device slots (%.1f MiB), the rest swapped to host",
        len(mcfg.attention_layers), mcfg.num_layers, pool.bytes_per_request / 2**20, len(mcfg.linear_layers),
        " + ".join(f"{s.name} {list(s.shape)} {str(s.dtype).removeprefix('torch.')}" for s in pool.specs),
        pool.num_spec_rows, pool.max_resident, pool.device_bytes / 2**20,
    )
    if checkpoints is not None:
        logger.info(
            "prefix caching on a hybrid model: state checkpoints of %.2f MiB each, every %d tokens of a prompt, "
            "at its last full block, at branch points and at the end of each output; %d on the device "
            "(%.1f MiB), up to %d in host memory", pool.bytes_per_state / 2**20, config.state_checkpoint_interval,
            pool.num_checkpoint_rows, pool.num_checkpoint_rows * pool.bytes_per_state / 2**20,
            checkpoints.max_host_checkpoints)
