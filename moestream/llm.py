"""`LLM`: the offline API, mirroring vLLM's `LLM` so users can switch."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch
from tqdm import tqdm

from moestream.config import EngineConfig
from moestream.engine.llm_engine import LLMEngine, PromptType
from moestream.outputs import RequestOutput
from moestream.sampling_params import SamplingParams
from moestream.threads import resolve_threads

logger = logging.getLogger(__name__)


class LLM:
    """Offline generation over a continuous-batching engine.

    Example:
        llm = LLM(model="path/to/checkpoint", dtype="float32")
        outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
        print(outs[0].outputs[0].text)

    Arguments are EngineConfig's (see there for units and defaults), and `threads`: torch's
    intra-op threads, set for this process (`moestream.threads`): an int, 'auto' (default: on
    CPU every core this process may run on; 2 beat 1 by 1.3-1.6x on an idle 2-core machine)
    or None (leave torch's setting). The choice is logged.

    Raises:
        ValueError: bad arguments, a missing model directory, or an unreadable checkpoint.
    """

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str = "cpu",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        seed: int = 0,
        expert_budget: float | int | None = None,
        expert_host_cache_bytes: int = 0,
        expert_policy: str = "next_use",
        expert_prefetch: str = "auto",
        expert_pin_profile: str | None = None,
        enable_elastic_memory: bool = False,
        record_routing: str | None = None,
        max_resident_states: int | None = None,
        mamba_ssm_cache_dtype: str = "float32",
        generation_config: str = "auto",
        max_logprobs: int = 20,
        enable_prefix_caching: bool = True,
        state_checkpoint_interval: int = 512,
        max_state_checkpoints: int | None = None,
        state_checkpoint_host_bytes: int = 1 << 30,
        speculative_config: dict | None = None,
        limit_mm_per_prompt: dict | None = None,
        max_image_pixels: int = 8192 * 8192,
        batch_invariant: bool = False,
        threads: int | str | None = "auto",
    ) -> None:
        n = resolve_threads(threads, device)
        before = torch.get_num_threads()
        if n is not None:
            torch.set_num_threads(n)
        try:
            self.llm_engine = LLMEngine(
                EngineConfig(
                    model=model,
                    dtype=dtype,
                    device=device,
                    max_model_len=max_model_len,
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens,
                    block_size=block_size,
                    kv_cache_memory_bytes=kv_cache_memory_bytes,
                    seed=seed,
                    expert_budget=expert_budget,
                    expert_host_cache_bytes=expert_host_cache_bytes,
                    expert_policy=expert_policy,
                    expert_prefetch=expert_prefetch,
                    expert_pin_profile=expert_pin_profile,
                    enable_elastic_memory=enable_elastic_memory,
                    record_routing=record_routing,
                    max_resident_states=max_resident_states,
                    mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
                    generation_config=generation_config,
                    max_logprobs=max_logprobs,
                    enable_prefix_caching=enable_prefix_caching,
                    state_checkpoint_interval=state_checkpoint_interval,
                    max_state_checkpoints=max_state_checkpoints,
                    state_checkpoint_host_bytes=state_checkpoint_host_bytes,
                    speculative_config=speculative_config,
                    limit_mm_per_prompt=limit_mm_per_prompt,
                    max_image_pixels=max_image_pixels,
                    batch_invariant=batch_invariant,
                )
            )
        except BaseException:
            torch.set_num_threads(before)  # a failed LLM() leaves the process as it found it
            raise
        logger.info("torch threads: %d%s", torch.get_num_threads(),
                    " (auto: every core this process may run on)" if threads == "auto" and n is not None else "")

    def spec_decode_stats(self) -> dict:
        """Speculative decoding counters: num_drafts, num_draft_tokens, num_accepted_tokens,
        acceptance_rate, mean_acceptance_length (see LLMEngine.spec_decode_stats)."""
        return self.llm_engine.spec_decode_stats()

    def expert_stats(self) -> dict:
        """Expert-cache metrics: hit_rate, hits, misses, stall_seconds, bytes_read (bytes),
        per layer and per tier (see moestream.experts.metrics.ExpertStats)."""
        return self.llm_engine.expert_stats()

    def kv_cache_stats(self) -> dict:
        """KV cache figures: bytes_per_token (bytes), block_size (tokens), num_blocks,
        free_blocks, and for MLA models mha_bytes_per_token (what an expanded MHA cache would
        take per token)."""
        return self.llm_engine.kv_cache_stats()

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache figures: enabled, queries and hits (prompt tokens of admitted
        requests), hit_rate, evictions (blocks), cached_blocks."""
        return self.llm_engine.prefix_cache_stats()

    def get_tokenizer(self):  # -> transformers.PreTrainedTokenizerBase
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams `generate` uses when given none: the built-in defaults, with the
        fields the model's generation_config.json sets (repetition_penalty, temperature, top_k,
        top_p, min_p, max_new_tokens) taking their place, as vLLM's `LLM`. An explicit
        SamplingParams is used as given."""
        return SamplingParams(**self.llm_engine.default_sampling_fields)

    def _add(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[str]:
        """Validate every prompt and params, then queue them all; nothing is queued on error."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and not isinstance(prompts[0], (str, dict, list, tuple))
        ):
            prompts = [prompts]  # one prompt: a str, a dict or a list of token ids
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts must be a prompt or a non-empty list of prompts, got {prompts!r:.80}")
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params; pass one or one per prompt")
        else:
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}")
        return self.llm_engine.add_requests([(None, p, sp) for p, sp in zip(prompts, params)])

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in order.

        A prompt is a str, a list of token ids, {"prompt": str} or {"prompt_token_ids": [...]},
        either dict optionally with images and videos (multimodal checkpoints):
        {"multi_modal_data": {"image": PIL image or list, "video": frames or list}}, a video's
        frames a uint8 array [T, H, W, 3] or a list of PIL images, or (frames, {"fps": ...});
        one `<|image_pad|>` / `<|video_pad|>` placeholder per item in the prompt, as the chat
        template writes;
        `sampling_params` is one object for all prompts or a list with one per prompt.

        Raises:
            ValueError: a bad prompt or parameter; nothing is queued then.
        """
        ids = self._add(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm) as bar:
            for out in self._run(ids):
                if out.finished:
                    final[out.request_id] = out
                    bar.update()
        return [final[i] for i in ids]

    def generate_stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Like `generate`, but yields each request's cumulative output every time it grows.
        Closing the iterator early aborts its unfinished requests and frees their blocks."""
        yield from self._run(self._add(prompts, sampling_params))

    def _run(self, ids: list[str]) -> Iterator[RequestOutput]:
        """Step until the requests `ids` finish, yielding their outputs; on exit (done, closed
        or interrupted), abort those of them still in flight."""
        engine = self.llm_engine
        mine = set(ids)
        pending = set(ids)
        try:
            while pending:
                for out in engine.step():
                    if out.request_id in mine:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
                pending.intersection_update(engine.requests)  # requests aborted elsewhere end too
        finally:
            for rid in pending:
                engine.abort_request(rid)
