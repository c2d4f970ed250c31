"""The engine: add / step / abort / stats, over scheduler -> runner -> sampler -> update ->
outputs. Its parts are made by `builder.build_engine`; speculative decoding's side is the
`Speculator`. Follows the shape of vLLM's LLMEngine and nano-vllm's llm_engine.py."""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import fields

import torch

from moestream.config import EngineConfig, check_request_expert_mode
from moestream.engine.builder import EngineParts, auto_compute_dtype, build_engine
from moestream.engine.detokenizer import IncrementalDetokenizer
from moestream.engine.input_processor import PromptType
from moestream.engine.kv_cache import KVCacheManager
from moestream.engine.request import ProcessedPrompt, Request, RequestStatus
from moestream.engine.scheduler import SchedulerOutput
from moestream.experts.expert_mode import cache_salt
from moestream.outputs import RequestOutput
from moestream.sampler import SamplerOutput, first_rows, make_generator
from moestream.sampling_params import SamplingParams
from moestream.spec_decode.ngram import NgramProposer
from moestream.spec_decode.speculator import DISABLED_STATS
from moestream.spec_decode.verifier import accept_tokens

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PromptType", "auto_compute_dtype"]


class LLMEngine:
    """Continuous-batching engine over a paged KV cache. Its parts (`EngineParts`: model
    config, tokenizer, scheduler, coordinator, runner, sampler, expert store, ...) are
    attributes of the same names.

    Raises (constructor):
        ValueError: a bad config, a missing/unreadable checkpoint or tokenizer, or a KV
            budget too small for one max_model_len sequence.
    """

    def __init__(self, config: EngineConfig) -> None:
        parts = build_engine(config)
        for f in fields(EngineParts):
            setattr(self, f.name, getattr(parts, f.name))
        self.config, self.speculative_config = config, config.speculative_config
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    @property
    def proposer(self) -> NgramProposer | None:
        """The n-gram proposer of speculative method "ngram" (tests may set a scripted one)."""
        return self.speculator.proposer if self.speculator is not None else None

    @proposer.setter
    def proposer(self, value: NgramProposer) -> None:
        self.speculator.proposer = value

    @property
    def kv_cache(self) -> KVCacheManager:  # the full-attention layers' block pool
        return self.coordinator.kv

    def process_prompt(self, prompt: PromptType | ProcessedPrompt) -> ProcessedPrompt:
        """A prompt validated and tokenized (`InputProcessor.process`; a str is tokenized
        with special tokens, as vLLM); a `ProcessedPrompt` is returned as is.

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, a prompt that
                leaves no room for output under max_model_len, or an unknown prompt type.
        """
        return prompt if isinstance(prompt, ProcessedPrompt) else ProcessedPrompt(*self.input_processor.process(prompt))

    def add_request(self, prompt: PromptType | ProcessedPrompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id. Raises ValueError on bad input, with
        nothing queued and no request in flight affected."""
        params = params if params is not None else SamplingParams()
        self.check_params(params)
        p = self.process_prompt(prompt)
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.requests:
                request_id = str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id '{request_id}' is already in flight; give each request a unique id")
        grammar = self.grammar_backend.matcher(params.structured_outputs, p.prompt_token_ids)
        req = Request(request_id, p.prompt, p.prompt_token_ids, params, generator=make_generator(params.seed, self.device),
                      mm_inputs=p.mm_inputs, cartridge=p.cartridge, cartridge_route=p.cartridge_route, grammar=grammar,
                      cache_salt=cache_salt(params.expert_mode, self.expert_mode))
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, p.prompt_token_ids, params.skip_special_tokens)
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        return request_id

    def add_requests(self, items: Sequence[tuple[str | None, PromptType | ProcessedPrompt, SamplingParams]]
                     ) -> list[str]:
        """Queue (request id or None, prompt, params) items all or none: every item is
        validated and tokenized first, once; returns their ids in order.

        Raises:
            ValueError: a bad prompt or parameter, or a request id already in flight or given
                twice; nothing is queued then.
        """
        ids = [rid for rid, _, _ in items if rid is not None]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique within one call")
        checked = []
        for rid, prompt, params in items:
            self.check_params(params)
            if rid is not None and rid in self.requests:
                raise ValueError(f"request id '{rid}' is already in flight; give each request a unique id")
            checked.append((rid, self.process_prompt(prompt), params))
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
            ValueError: not a SamplingParams, more (prompt) logprobs than max_logprobs, a stop
                or logit_bias token id outside the vocabulary, or a constraint that does not compile.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        for kind, n in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):  # vLLM's wording
            if n is not None and n > self.config.max_logprobs:
                raise ValueError(f"Requested {kind} logprobs of {n}, which is greater than max allowed: "
                                 f"{self.config.max_logprobs}; ask for fewer or raise the engine's max_logprobs")
        check_request_expert_mode(params.expert_mode, self.config.expert_mode)
        if params.structured_outputs is not None:  # compiled once per key: bad constraints refused before queuing
            self.grammar_backend.compile(params.structured_outputs)
        vocab = self.model_config.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias token ids", params.logit_bias or ())):
            if bad := [t for t in ids if not 0 <= t < vocab]:
                raise ValueError(f"{name} must be in [0, {vocab}); got {bad[:5]}")

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

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, update and detokenize once. Returns the outputs
        of the requests that produced a token or finished in this step (cumulative, as vLLM)."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        self.grammar_backend.prefetch([r.grammar for r, _ in sched.scheduled if r.grammar is not None])
        samplers, logits, starts, first = self._execute(sched)
        now = time.monotonic()  # only now, with nothing left that can fail, does the step's progress count
        self.output_processor.add_prompt_logprobs(self.runner.prompt_logprobs)
        finished = accept_tokens(samplers, logits, starts, first, self._sample,
                                 lambda r, t, lps: self.output_processor.append_token(r, t, lps, now),
                                 self.speculator) if samplers else {}
        for req in self.scheduler.update_from_output(sched, samplers, finished):
            req.finished_time = now
            self.requests.pop(req.request_id, None)
        if self.speculator is not None:
            self.speculator.propose([r for i, r in enumerate(samplers) if i not in finished],
                                    [r for r, _ in sched.scheduled if not r.status.is_finished])
            self.speculator.maybe_log(now)
        return [self.output_processor.make_output(r) for r in samplers]

    def _execute(self, sched: SchedulerOutput) -> tuple[list[Request], torch.Tensor, list[int], SamplerOutput | None]:
        """Run the model on `sched` and sample each sampling request's first row: (samplers,
        logits [rows, V], each sampler's first row, its first samples). On an error, a hybrid
        model's step states are discarded and its requests recompute them; then it raises."""
        spec = self.speculator
        decode_only = spec is not None and spec.adaptive is not None and all(  # steps adaptive k's cost model times
            n == 1 + len(r.spec_token_ids) and r.num_computed_tokens == r.num_tokens - 1 for r, n in sched.scheduled)
        try:
            t0 = time.perf_counter()
            samplers, logits, num_rows = self.runner.execute(sched, self.coordinator)
            if decode_only:
                spec.record_step(sched.num_tokens, time.perf_counter() - t0)
            starts = list(itertools.accumulate([0] + num_rows[:-1]))
            return samplers, logits, starts, self._sample(samplers, first_rows(logits, starts)) if samplers else None
        except Exception:
            if self.state_pool is not None:
                self.coordinator.discard()
                # Rewriting KV slots is idempotent, advancing a recurrent state is not: the
                # step's linear-attention states may be part-updated, so recompute them.
                for req, _ in sched.scheduled:
                    self.scheduler.reset_request(req)
            raise

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> SamplerOutput:
        """Sample one token for each of `reqs` from its row of `logits` [len(reqs), V]."""
        return self.sampler(logits, [r.sampling_params for r in reqs], [r.prompt_token_ids for r in reqs],
                            [r.output_token_ids for r in reqs], [r.generator for r in reqs], [r.grammar for r in reqs])

    # ---- stats ----------------------------------------------------------------------

    def save_routing_trace(self) -> None:
        """Write the routing recorded so far to `record_routing` (no-op when not recording)."""
        if self.recorder is not None and self.config.record_routing:
            self.recorder.save(self.config.record_routing)

    def expert_stats(self) -> dict:
        """Expert-cache metrics (ExpertStats.as_dict: hit_rate, hits, misses, stall_seconds, bytes_read, per layer
        and tier); `elastic_memory` (pages per owner, resizes) and `expert_mode` (`ResidentFold.stats`) when on."""
        stats = self.expert_store.stats()
        for name, part in (("elastic_memory", self.elastic_memory), ("expert_mode", self.expert_mode)):
            if part is not None:
                stats[name] = part.stats()
        return stats

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache figures (`KVCacheCoordinator.prefix_cache_stats`): enabled, queries
        and hits (prompt tokens of admitted requests), hit_rate, evictions (blocks),
        cached_blocks, recomputed_tokens (hybrid hits), and on hybrid models the state
        checkpoints per tier (count, bytes), captured, evictions, demotions."""
        return self.coordinator.prefix_cache_stats()

    def kv_cache_stats(self) -> dict:
        """KV cache figures: bytes_per_token (a block's token slot), block_size, num_blocks and
        free_blocks, `groups` (per KV cache group: kind, window, used_blocks), and for MLA
        `mha_bytes_per_token`, what expanded per-head keys and values would take."""
        kv, mla = self.coordinator.kv, self.kv_cache_mha_bytes_per_token
        return {"bytes_per_token": self.kv_cache_bytes_per_token, "block_size": self.config.block_size, "num_blocks":
                kv.num_blocks, "free_blocks": kv.num_free_blocks, "groups": self.coordinator.kv_group_stats(),
                **({"mha_bytes_per_token": mla} if mla is not None else {})}

    def spec_decode_stats(self) -> dict:
        """Speculative decoding counters (vLLM's names): num_drafts (steps with drafts, per
        request), num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos (list of
        num_speculative_tokens: drafts accepted at position j), acceptance_rate (accepted /
        draft tokens), mean_acceptance_length (tokens per drafted step: 1 + accepted / drafts),
        with adaptive k the fitted step cost (`step_cost_ratio`: the time one more verified
        token adds over a decode token's time), and `enabled`."""
        return self.speculator.stats_dict() if self.speculator is not None else copy.deepcopy(DISABLED_STATS)
