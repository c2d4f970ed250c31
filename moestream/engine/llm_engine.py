"""The engine: add_request / step / abort_request, over scheduler -> runner -> sampler ->
detokenizer. Follows the shape of vLLM's LLMEngine and nano-vllm's llm_engine.py."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

import torch

from moestream.config import EngineConfig, ModelConfig, resolve_dtype
from moestream.engine.detokenizer import IncrementalDetokenizer
from moestream.engine.input_processor import InputProcessor, PromptType
from moestream.engine.elastic_memory import ElasticMemory, PageGeometry
from moestream.engine.kv_cache import KVCacheManager, kv_block_bytes, num_kv_blocks
from moestream.engine.kv_cache_coordinator import KVCacheCoordinator
from moestream.engine.model_runner import ModelRunner
from moestream.engine.output_processor import OutputProcessor
from moestream.engine.request import Request, RequestStatus
from moestream.engine.scheduler import Scheduler
from moestream.engine.state_checkpoints import StateCheckpointPool
from moestream.engine.state_pool import StatePool
from moestream.experts.planner import plan_experts
from moestream.experts.policy import make_policy
from moestream.experts.resident import ResidentExpertStore
from moestream.experts.store import PagedExpertStore, load_pin_profile
from moestream.experts.trace import RoutingRecorder
from moestream.generation_config import default_sampling_fields
from moestream.layers.attention_backend import TorchAttentionBackend
from moestream.layers.linear import BATCH_INVARIANT_ROW_TILE, cpu_has_native_bf16, process_weights_after_loading
from moestream.loader import (
    CheckpointReader,
    build_model,
    expert_locations,
    load_resident_experts,
    load_tokenizer,
)
from moestream.models.moe_decoder import MoEForCausalLM
from moestream.models.registry import get_model_class
from moestream.multimodal.inputs import MultiModalInputs
from moestream.multimodal.processor import MultiModalProcessor
from moestream.multimodal.vision import load_vision_encoder
from moestream.outputs import RequestOutput
from moestream.sampler import Sampler, make_generator
from moestream.sampling_params import SamplingParams
from moestream.spec_decode.adaptive import AdaptiveK
from moestream.spec_decode.mtp import load_mtp
from moestream.spec_decode.ngram import NgramProposer

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PromptType"]

# A state checkpoint is a whole request state (about 74 MiB on Qwen3-Next-80B): few on the
# device by default, the rest in host memory (state_checkpoint_host_bytes).
_DEFAULT_DEVICE_CHECKPOINTS = 8
# Seconds between the speculative decoding acceptance log lines (vLLM logs every 10 s).
_SPEC_LOG_INTERVAL = 10.0


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


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Raises (constructor):
        ValueError: a bad config, a missing/unreadable checkpoint or tokenizer, or a KV
            budget too small for one max_model_len sequence.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = mcfg = ModelConfig.from_hf(config.model)
        if config.batch_invariant and (mcfg.mla is not None or mcfg.is_hybrid):  # before any weight loads
            name = get_model_class(mcfg.model_type).display_name or mcfg.model_type
            raise ValueError(f"batch_invariant is not supported for {name} (multi-head latent attention "
                             "and linear-attention layers are not covered); turn batch_invariant off")
        self.tokenizer = load_tokenizer(config.model)
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, mcfg.torch_dtype)
        if config.dtype == "auto":
            self.dtype = auto_compute_dtype(self.dtype, self.device, cpu_has_native_bf16())
        self.default_sampling_fields = default_sampling_fields(config.generation_config, config.model)
        if self.default_sampling_fields:
            logger.info("default sampling parameters from the model's generation config: %s (they apply where a "
                        "request leaves a field unset; generation_config='vllm' turns them off)",
                        self.default_sampling_fields)
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{mcfg.max_position_embeddings}; lower max_model_len"
            )
        self.mm_processor = None
        if mcfg.multimodal is not None:
            self.mm_processor = MultiModalProcessor(config.model, mcfg.multimodal, config.limit_mm_per_prompt,
                                                    config.max_image_pixels)
        self.input_processor = InputProcessor(self.tokenizer, mcfg.vocab_size, self.max_model_len, self.mm_processor)
        model = self._load(mcfg)
        bs = config.block_size
        num_kv_layers = len(mcfg.attention_layers) + (self.mtp is not None)  # the MTP layer has a KV cache too
        heads, k_dim, v_dim = mcfg.kv_cache_dims
        self.kv_cache_block_bytes = block_bytes = kv_block_bytes(num_kv_layers, bs, heads, k_dim, self.dtype, v_dim)
        self._log_kv_bytes(mcfg, num_kv_layers, block_bytes // bs)
        num_blocks = num_kv_blocks(config.kv_cache_memory_bytes, block_bytes, bs, self.max_model_len,
                                   config.max_num_seqs)
        elastic = self.elastic_memory
        if elastic is not None:
            num_blocks = elastic.num_blocks
        kv_cache = KVCacheManager(num_blocks, bs, config.enable_prefix_caching,
                                  offline_blocks=elastic.offline_blocks() if elastic is not None else ())
        if elastic is not None:
            elastic.bind(self.expert_store, kv_cache)
        self.state_pool = self._make_state_pool(mcfg) if mcfg.is_hybrid else None
        checkpoints = None
        if self.state_pool is not None and config.enable_prefix_caching:
            checkpoints = StateCheckpointPool(self.state_pool, config.state_checkpoint_host_bytes)
        self.coordinator = KVCacheCoordinator(kv_cache, self.state_pool, checkpoints, config.state_checkpoint_interval,
                                              elastic)
        self.scheduler = Scheduler(self.coordinator, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, num_blocks, bs, self.dtype, self.device, self.state_pool, self.recorder,
                                  self.mtp, self.vision, elastic.kv_caches() if elastic is not None else None)
        self.sampler = Sampler(config.seed, self.device)
        eos = set(mcfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.speculative_config = config.speculative_config
        sc = self.speculative_config
        self.proposer = NgramProposer(sc) if sc is not None and sc.method == "ngram" else None
        self.adaptive = AdaptiveK(sc.num_speculative_tokens) if sc is not None and sc.adaptive else None
        self.spec_stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                           "num_accepted_tokens_per_pos": [0] * (sc.num_speculative_tokens if sc else 0)}
        self._spec_log_time = time.monotonic()
        self._spec_log_drafts = 0
        if self.speculative_config is not None:
            logger.info("speculative decoding: %s", self.speculative_config)
        dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        plan = self.expert_plan
        logger.info(
            "model %s (%s, %s): dense weights %.1f MiB resident; routed experts %.1f MiB in all, %s; "
            "KV cache %d blocks x %d tokens (%d bytes each, %.1f MiB); max_model_len %d",
            config.model, mcfg.model_type, self.dtype, dense_bytes / 2**20, plan.total_bytes / 2**20,
            "all resident" if plan.resident else (
                f"{plan.num_slots} device slots of {plan.expert_bytes} bytes ({plan.num_slots * plan.expert_bytes / 2**20:.1f} "
                f"MiB), host cache {plan.host_cache_experts} experts, policy {config.expert_policy}, "
                f"prefetch {config.resolved_expert_prefetch}"
                f"{' into slots' if self.device.type == 'cuda' else ' as page-cache read-ahead'}"),
            kv_cache.num_blocks, bs, block_bytes, kv_cache.num_blocks * block_bytes / 2**20, self.max_model_len,
        )
        if self.elastic_memory is not None:
            st = self.elastic_memory.stats()
            logger.info("elastic memory: %d pages of %d bytes (one expert slot or %d KV blocks each), %d start as "
                        "expert slots and %d as KV blocks", st["num_pages"], st["page_bytes"], st["blocks_per_page"],
                        st["expert_pages"], st["kv_pages"])
        if self.state_pool is not None:
            pool = self.state_pool
            logger.info(
                "hybrid model: KV cache for %d of %d layers (full attention); linear-attention state %.2f MiB per "
                "request (%d layers, conv %s %s + recurrent %s %s, with %d speculative rows); %d device slots "
                "(%.1f MiB), the rest swapped to host",
                len(mcfg.attention_layers), mcfg.num_layers, pool.bytes_per_request / 2**20, len(mcfg.linear_layers),
                list(pool.conv_shape), str(pool.conv_dtype).removeprefix("torch."), list(pool.ssm_shape),
                str(pool.ssm_dtype).removeprefix("torch."), pool.num_spec_rows, pool.max_resident, pool.device_bytes / 2**20,
            )
            if checkpoints is not None:
                logger.info(
                    "prefix caching on a hybrid model: state checkpoints of %.2f MiB each, every %d tokens of a prompt, "
                    "at its last full block, at branch points and at the end of each output; %d on the device "
                    "(%.1f MiB), up to %d in host memory", pool.bytes_per_state / 2**20, config.state_checkpoint_interval,
                    pool.num_checkpoint_rows, pool.num_checkpoint_rows * pool.bytes_per_state / 2**20,
                    checkpoints.max_host_checkpoints)

    def _make_state_pool(self, mcfg: ModelConfig) -> StatePool:
        """Device state slots for `max_resident_states` requests (default max_num_seqs)."""
        cfg = self.config
        conv_dim = 2 * mcfg.linear_num_key_heads * mcfg.linear_key_head_dim + (
            mcfg.linear_num_value_heads * mcfg.linear_value_head_dim
        )
        return StatePool(
            len(mcfg.linear_layers),
            (conv_dim, mcfg.linear_conv_kernel_dim - 1),
            (mcfg.linear_num_value_heads, mcfg.linear_key_head_dim, mcfg.linear_value_head_dim),
            self.dtype,
            self.dtype if cfg.mamba_ssm_cache_dtype == "auto" else resolve_dtype(cfg.mamba_ssm_cache_dtype, None),
            cfg.max_resident_states or cfg.max_num_seqs,
            self.device,
            num_checkpoint_rows=0 if not cfg.enable_prefix_caching else (
                cfg.max_state_checkpoints if cfg.max_state_checkpoints is not None
                else min(_DEFAULT_DEVICE_CHECKPOINTS, cfg.max_resident_states or cfg.max_num_seqs)),
            num_spec_rows=cfg.speculative_config.num_speculative_tokens if cfg.speculative_config else 0,
        )

    def _log_kv_bytes(self, mcfg: ModelConfig, num_kv_layers: int, per_token: int) -> None:
        """Log the KV cache's bytes per token; for MLA, against the expanded per-head keys and
        values an MHA cache would hold."""
        self.kv_cache_bytes_per_token = per_token
        if mcfg.mla is None:
            logger.info("KV cache: %d bytes per token (%d layers)", per_token, num_kv_layers)
            return
        m, elem = mcfg.mla, torch.tensor([], dtype=self.dtype).element_size()
        mha = num_kv_layers * mcfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * elem
        logger.info("KV cache (MLA latent, kv_lora_rank %d + qk_rope_head_dim %d): %d bytes per token (%d layers); "
                    "expanded MHA keys and values would take %d (%.1fx)", m.kv_lora_rank, m.qk_rope_head_dim,
                    per_token, num_kv_layers, mha, mha / per_token)
        self.kv_cache_mha_bytes_per_token = mha

    def _load(self, mcfg: ModelConfig) -> MoEForCausalLM:
        """Plan expert residency, build the expert store, and load the model."""
        config = self.config
        reader = CheckpointReader(config.model)
        self.recorder = RoutingRecorder() if config.record_routing else None
        pinned = load_pin_profile(config.expert_pin_profile, mcfg) if config.expert_pin_profile else []
        moe_layers = [i for i, m in enumerate(mcfg.moe_layers) if m]
        elem = torch.tensor([], dtype=self.dtype).element_size()
        self.expert_plan = plan = plan_experts(
            config.expert_budget,
            len(moe_layers) * mcfg.num_experts,
            3 * mcfg.moe_intermediate_size * mcfg.hidden_size * elem,
            mcfg.num_experts_per_tok,
            len(pinned),
            config.expert_host_cache_bytes,
        )
        store: ResidentExpertStore | PagedExpertStore
        sc = config.speculative_config
        self.elastic_memory = None
        if config.enable_elastic_memory:
            if plan.resident:
                raise ValueError("enable_elastic_memory shares memory between paged experts and the KV cache; give "
                                 "an expert_budget below the routed experts' size (e.g. 0.5)")
            num_kv_layers = len(mcfg.attention_layers) + (sc is not None and sc.method == "mtp")
            if num_kv_layers == 0:
                raise ValueError("enable_elastic_memory needs a model with attention layers")
            geometry = PageGeometry(mcfg.moe_intermediate_size, mcfg.hidden_size, num_kv_layers, config.block_size,
                                    *mcfg.kv_cache_dims)
            kv_blocks = num_kv_blocks(config.kv_cache_memory_bytes, geometry.block_elems * elem, config.block_size,
                                      self.max_model_len, config.max_num_seqs)
            self.elastic_memory = ElasticMemory(geometry, plan.num_slots, -(-kv_blocks // geometry.blocks_per_page),
                                                self.dtype, self.device)
        if plan.resident:
            store = ResidentExpertStore(self.recorder)
        else:
            store = PagedExpertStore(
                expert_locations(mcfg, reader), mcfg.num_layers, moe_layers, mcfg.num_experts,
                mcfg.moe_intermediate_size, mcfg.hidden_size, self.dtype, self.device, plan.num_slots,
                plan.host_cache_experts, make_policy(config.expert_policy), pinned, config.resolved_expert_prefetch,
                "slots" if self.device.type == "cuda" else "page_cache", mcfg.num_experts_per_tok, self.recorder,
                compute_in_place=self.device.type == "cpu",
                slot_views=self.elastic_memory.expert_views() if self.elastic_memory is not None else None,
            )
        model = build_model(mcfg, reader, self.dtype, self.device, TorchAttentionBackend(config.batch_invariant), store)
        if config.batch_invariant:
            model.set_row_tile(BATCH_INVARIANT_ROW_TILE)
        if plan.resident:
            load_resident_experts(mcfg, reader, self.dtype, self.device, store)
        self.expert_store = store
        self.vision = load_vision_encoder(mcfg.multimodal, reader, self.dtype, self.device) if (
            mcfg.multimodal is not None) else None
        self.mtp = load_mtp(mcfg, reader, self.dtype, self.device, TorchAttentionBackend()) if (
            sc is not None and sc.method == "mtp") else None
        packed = process_weights_after_loading(model) + (
            process_weights_after_loading(self.mtp) if self.mtp is not None else 0)
        if packed:
            logger.info("%d dense weights prepacked for oneDNN's bf16 matmul", packed)
        return model

    def save_routing_trace(self) -> None:
        """Write the routing recorded so far to `record_routing` (no-op when not recording)."""
        if self.recorder is not None and self.config.record_routing:
            self.recorder.save(self.config.record_routing)

    def expert_stats(self) -> dict:
        """Expert-cache metrics (see ExpertStats.as_dict): hit_rate, hits, misses, stall_seconds,
        bytes_read, per-layer and per-tier figures; with elastic memory, `elastic_memory`:
        its pages per owner and resizes so far."""
        stats = self.expert_store.stats()
        if self.elastic_memory is not None:
            stats["elastic_memory"] = self.elastic_memory.stats()
        return stats

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache figures (`KVCacheCoordinator.prefix_cache_stats`): enabled, queries
        and hits (prompt tokens of admitted requests), hit_rate, evictions (blocks),
        cached_blocks, recomputed_tokens (hybrid hits), and on hybrid models the state
        checkpoints per tier (count, bytes), captured, evictions, demotions."""
        return self.coordinator.prefix_cache_stats()

    def kv_cache_stats(self) -> dict:
        """KV cache figures: bytes_per_token (bytes, all KV layers), block_size (tokens),
        num_blocks and free_blocks (now), and for MLA models `mha_bytes_per_token`, what
        expanded per-head keys and values would take."""
        kv = self.coordinator.kv
        stats = {"bytes_per_token": self.kv_cache_bytes_per_token, "block_size": self.config.block_size,
                 "num_blocks": kv.num_blocks, "free_blocks": kv.num_free_blocks}
        if self.model_config.mla is not None:
            stats["mha_bytes_per_token"] = self.kv_cache_mha_bytes_per_token
        return stats

    @property
    def kv_cache(self) -> KVCacheManager:
        return self.coordinator.kv

    # ---- requests -------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int], MultiModalInputs | None]:
        """(text or None, token ids, multimodal inputs or None) of a prompt: see
        `InputProcessor.process` (a str is tokenized with special tokens, as vLLM).

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, a prompt that
                leaves no room for output under max_model_len, or an unknown prompt type.
        """
        return self.input_processor.process(prompt)

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id. Raises ValueError on bad input, with
        nothing queued and no request in flight affected."""
        params = params if params is not None else SamplingParams()
        self.check_params(params)
        text, ids, mm = self.tokenize_prompt(prompt)
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.requests:
                request_id = str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id '{request_id}' is already in flight; give each request a unique id")
        req = Request(request_id, text, ids, params, generator=make_generator(params.seed, self.device), mm_inputs=mm)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        return request_id

    def add_requests(self, items: Sequence[tuple[str | None, PromptType, SamplingParams]]) -> list[str]:
        """Queue (request id or None, prompt, params) items all or none: every item is
        validated and tokenized first; returns their ids in order.

        Raises:
            ValueError: a bad prompt or parameter, or a request id already in flight or given
                twice; nothing is queued then.
        """
        checked = []
        ids = [rid for rid, _, _ in items if rid is not None]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique within one call")
        for rid, prompt, params in items:
            self.check_params(params)
            if rid is not None and rid in self.requests:
                raise ValueError(f"request id '{rid}' is already in flight; give each request a unique id")
            text, token_ids, mm = self.tokenize_prompt(prompt)  # tokenized once, here
            checked.append((rid, {"prompt": text, "prompt_token_ids": token_ids, "mm_inputs": mm}, params))
        added: list[str] = []
        try:
            for rid, prompt, params in checked:
                added.append(self.add_request(prompt, params, rid))
        except BaseException:
            for rid in added:  # all or none
                self.abort_request(rid)
            raise
        return added

    def check_params(self, params: SamplingParams) -> None:
        """Checks of SamplingParams against this engine's limits.

        Raises:
            ValueError: not a SamplingParams, more logprobs than max_logprobs, or a stop
                token id outside the vocabulary.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(
                f"logprobs={params.logprobs} is more than max_logprobs={self.config.max_logprobs}; ask for fewer "
                "or raise the engine's max_logprobs"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}); got {bad[:5]}")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its blocks. Returns its final output, or None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        req.finished_time = time.monotonic()
        return self.output_processor.make_output(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- stepping -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample and detokenize once. Returns the outputs of the
        requests that produced a token or finished in this step (cumulative, as vLLM)."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        decode_only = self.adaptive is not None and all(  # steps the adaptive-k cost model times
            n == 1 + len(r.spec_token_ids) and r.num_computed_tokens == r.num_tokens - 1 for r, n in sched.scheduled)
        try:
            t0 = time.perf_counter()
            samplers, logits, num_rows = self.runner.execute(sched, self.coordinator)
            if decode_only:
                self.adaptive.cost.record(sched.num_tokens, time.perf_counter() - t0)
            starts = list(itertools.accumulate([0] + num_rows[:-1]))
            result = self._sample(samplers, logits[starts]) if samplers else None
        except Exception:
            if self.state_pool is not None:
                self.coordinator.discard()
                # Rewriting KV slots is idempotent, advancing a recurrent state is not: the
                # step's linear-attention states may be part-updated, so recompute them.
                for req, _ in sched.scheduled:
                    self.scheduler.reset_request(req)
            raise
        # Only now, with nothing left that can fail, does the step's progress count.
        now = time.monotonic()
        finished = self._update(samplers, logits, starts, result, now) if samplers else {}
        sampled = {id(r) for r in samplers}
        for req, n in sched.scheduled:
            # A request that sampled has computed all its tokens but the last one sampled (and
            # the KV of rejected draft positions is left to be overwritten).
            req.num_computed_tokens = req.num_tokens - 1 if id(req) in sampled else req.num_computed_tokens + n
            req.spec_token_ids = []
        self.coordinator.commit(sched.scheduled)
        outputs, continuing = [], []
        for i, req in enumerate(samplers):
            status = finished.get(i)
            if status is not None:
                self.scheduler.finish_request(req, status)
                req.finished_time = now
                self.requests.pop(req.request_id, None)
            else:
                continuing.append(req)
            outputs.append(self.output_processor.make_output(req))
        if self.speculative_config is not None and (continuing or self.runner.mtp is not None):
            self._propose(continuing, [r for r, _ in sched.scheduled if not r.status.is_finished])
        if self.speculative_config is not None and now - self._spec_log_time >= _SPEC_LOG_INTERVAL:
            self._log_spec_decode(now)
        return outputs

    def _sample(self, reqs: list[Request], logits: torch.Tensor):
        """Sample one token for each of `reqs` from its row of `logits` [len(reqs), V]."""
        return self.sampler(logits, [r.sampling_params for r in reqs], [r.prompt_token_ids for r in reqs],
                            [r.output_token_ids for r in reqs], [r.generator for r in reqs])

    def _update(self, samplers: list[Request], logits: torch.Tensor, starts: list[int], first,
                now: float) -> dict[int, RequestStatus]:
        """The update phase: append each request's sampled token (`first`: the samples of
        each request's first row). A request with draft tokens goes on to its next row while
        the token it sampled equals its draft there, so each output token is still the
        target model's own sample, drawn one position at a time from the request's generator
        as without drafts: greedy output is exact, and so is the sampled distribution. This
        is speculative decoding's verification (Leviathan et al. 2023) for a draft that is one
        fixed token per position. Returns {index in samplers: the status it finished with}.
        """
        finished: dict[int, RequestStatus] = {}
        active, result, j = list(range(len(samplers))), first, 0
        while active:
            if j > 0:
                result = self._sample([samplers[i] for i in active], logits[[starts[i] + j for i in active]])
            verify = []
            for i, token, lps, err in zip(active, result.token_ids, result.logprobs, result.errors):
                req = samplers[i]
                if err is not None:
                    logger.error("request %s aborted: its logits processor raised %r", req.request_id, err)
                    finished[i] = RequestStatus.FINISHED_ABORTED
                    continue
                draft = req.spec_token_ids
                if j == 0 and draft:
                    self.spec_stats["num_drafts"] += 1
                    self.spec_stats["num_draft_tokens"] += len(draft)
                accepted = j < len(draft) and token == draft[j]
                if accepted:
                    self.spec_stats["num_accepted_tokens"] += 1
                    self.spec_stats["num_accepted_tokens_per_pos"][j] += 1
                state = req.draft_state
                if state is not None and self.adaptive is not None:
                    if j < len(draft) and (not accepted or j + 1 == len(draft)):  # this verify is judged
                        self.adaptive.observe(state, len(draft), j + accepted)
                    elif not draft and state.shadow:  # would the shadow draft have been accepted?
                        self.adaptive.observe(state, 1, int(token == state.shadow[0]))
                    state.shadow = []
                status = self.output_processor.append_token(req, token, lps, now)
                if status is not None:
                    finished[i] = status
                elif accepted:
                    verify.append(i)
            active, j = verify, j + 1
        return finished

    def _draft_length(self, req: Request) -> int:
        """How many tokens `req` drafts next: at most num_speculative_tokens and what its
        max_tokens and max_model_len leave room for after the token the step samples; with
        adaptive k at most its current draft length (`AdaptiveK`), where length 0 sets a
        one-token shadow draft (n-gram, which costs nothing) to keep its acceptance measured."""
        sc = self.speculative_config
        room = min(sc.num_speculative_tokens, self.max_model_len - req.num_tokens - 1)
        if req.sampling_params.max_tokens is not None:
            room = min(room, req.sampling_params.max_tokens - req.num_output_tokens - 1)
        if room < 1 or self.adaptive is None:
            return max(room, 0)
        state = req.draft_state
        if state is None:
            state = req.draft_state = self.adaptive.new_state()
        before = state.k
        k = self.adaptive.choose(state, len(self.scheduler.running))
        if k == 0:
            if before > 0:
                logger.info("request %s: measured acceptance %.2f per drafted position makes drafting slower than "
                            "plain decode (a draft token costs %.2f of a decode token's time): k %d -> 0, drafts "
                            "resume when they start to match", req.request_id, state.acceptance,
                            self.adaptive.cost_ratio(len(self.scheduler.running)), before)
            if sc.method == "ngram":
                state.shadow = self.proposer.propose(req.token_ids, 1)
            elif state.probe():  # a draft costs a forward: measure with one token now and then
                return 1
            return 0
        if before == 0:
            logger.info("request %s: measured acceptance %.2f: drafting again, k 0 -> %d", req.request_id,
                        state.acceptance, k)
        return min(room, k)

    def _propose(self, reqs: list[Request], alive: list[Request]) -> None:
        """Set the draft tokens of the requests that go on (`reqs`: they sampled this step) in
        `spec_token_ids`, for their next step: n-gram lookups, one batched greedy draft pass
        over resident experts (`draft_experts`), or the MTP pass (`mtp`), which also runs over
        the step's other unfinished requests (`alive`: prefill chunks) to keep its KV cache
        complete. A draft that fails is dropped with an error log: drafts are an optimisation,
        never a reason to fail requests."""
        lengths = [self._draft_length(r) for r in reqs]
        method = self.speculative_config.method
        if method == "ngram":
            for req, n in zip(reqs, lengths):
                req.spec_token_ids = self.proposer.propose(req.token_ids, n) if n else []
            return
        if method == "mtp":
            want = {id(r): n for r, n in zip(reqs, lengths)}
            mtp_lengths = []
            for req in alive:  # blocks for the chained drafts' own KV positions, or one draft only
                n = want.get(id(req), 0)
                if n >= 2 and not self.coordinator.allocate_slots(req, req.num_tokens + n - 2):
                    n = 1
                mtp_lengths.append(n)
            t0 = time.perf_counter()
            try:
                drafts = self.runner.mtp_draft(alive, mtp_lengths, self.coordinator)
            except Exception:
                logger.exception("MTP pass failed; these requests go on without drafts")
                return
            if self.adaptive is not None:
                self.adaptive.record_draft(max(sum(mtp_lengths), 1), time.perf_counter() - t0)
            for req, d in zip(alive, drafts):
                req.spec_token_ids = d
            return
        for i, req in enumerate(reqs):  # blocks for the drafted positions, or no draft
            if lengths[i] and not self.coordinator.allocate_slots(req, req.num_tokens - 1 + lengths[i]):
                lengths[i] = 0
        todo = [i for i, n in enumerate(lengths) if n]
        if not todo:
            return
        t0 = time.perf_counter()
        try:
            drafts = self.runner.draft([reqs[i] for i in todo], [lengths[i] for i in todo], self.coordinator)
        except Exception:
            logger.exception("draft pass failed; these requests go on without drafts")
            return
        if self.adaptive is not None:
            self.adaptive.record_draft(sum(lengths[i] for i in todo), time.perf_counter() - t0)
        for i, d in zip(todo, drafts):
            reqs[i].spec_token_ids = d

    def _log_spec_decode(self, now: float) -> None:
        """Log speculative decoding's acceptance since the last log (vLLM's SpecDecoding
        metrics line), at most every `_SPEC_LOG_INTERVAL` seconds and only after drafts."""
        st = self.spec_decode_stats()
        if st["num_drafts"] == self._spec_log_drafts:
            return
        per_pos = [a / st["num_drafts"] for a in st["num_accepted_tokens_per_pos"]]
        logger.info("speculative decoding: mean acceptance length %.2f, acceptance rate %.1f%%, per-position "
                    "acceptance %s, %d drafts (totals)", st["mean_acceptance_length"], 100 * st["acceptance_rate"],
                    "[" + ", ".join(f"{x:.2f}" for x in per_pos) + "]", st["num_drafts"])
        self._spec_log_time, self._spec_log_drafts = now, st["num_drafts"]

    def spec_decode_stats(self) -> dict:
        """Speculative decoding counters (vLLM's names): num_drafts (steps with drafts, per
        request), num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos (list of
        num_speculative_tokens: drafts accepted at position j), acceptance_rate (accepted /
        draft tokens), mean_acceptance_length (tokens per drafted step: 1 + accepted / drafts),
        and with adaptive k the fitted step cost (`step_cost_ratio`: the time one more
        verified token adds over a decode token's time)."""
        st = dict(self.spec_stats)
        st["num_accepted_tokens_per_pos"] = list(st["num_accepted_tokens_per_pos"])
        if self.adaptive is not None:
            st["step_cost_ratio"] = self.adaptive.cost_ratio(1)
        st["acceptance_rate"] = st["num_accepted_tokens"] / st["num_draft_tokens"] if st["num_draft_tokens"] else 0.0
        st["mean_acceptance_length"] = 1 + st["num_accepted_tokens"] / st["num_drafts"] if st["num_drafts"] else 0.0
        st["enabled"] = self.speculative_config is not None
        return st
