"""`LLM`: the offline API, mirroring vLLM's `LLM` so users can switch."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from tqdm import tqdm

from moestream.engine.args import engine_config
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

    Keyword arguments are the engine options (`EngineConfig`'s fields, declared once in
    `moestream/config/engine.py`; `moestream generate --help` lists them as flags), among
    them `threads`: torch's intra-op threads, set for this process (`moestream.threads`): an
    int, 'auto' (default: on CPU the cores this process may use) or None (leave torch's
    setting). The choice is logged.

    Raises:
        TypeError: a keyword that is not an engine option.
        ValueError: bad arguments, a missing model directory, or an unreadable checkpoint.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        config = engine_config(model, **kwargs)
        n = resolve_threads(config.threads, config.device)
        before = torch.get_num_threads()
        if n is not None:
            torch.set_num_threads(n)
        try:
            self.llm_engine = LLMEngine(config)
        except BaseException:
            torch.set_num_threads(before)  # a failed LLM() leaves the process as it found it
            raise
        logger.info("torch threads: %d%s", torch.get_num_threads(),
                    " (auto: the cores this process may use)" if config.threads == "auto" and n is not None else "")

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
        cartridges: Sequence[str | dict] | None = None,
    ) -> list[str]:
        """Validate every prompt and params, then queue them all; nothing is queued on error."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and not isinstance(prompts[0], (str, dict, list, tuple))
        ):
            prompts = [prompts]  # one prompt: a str, a dict or a list of token ids
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts must be a prompt or a non-empty list of prompts, got {prompts!r:.80}")
        prompts = list(prompts)
        if cartridges is not None and any(isinstance(p, dict) and "cartridges" in p for p in prompts):
            raise ValueError("give cartridges either to generate() or in the prompt dicts, not both")
        if cartridges is not None:  # every prompt starts after them
            prompts = [{**(p if isinstance(p, dict) else {"prompt": p} if isinstance(p, str) else
                           {"prompt_token_ids": p}), "cartridges": cartridges} for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params; pass one or one per prompt")
        else:
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}")
        ids = self.llm_engine.add_requests([(None, p, sp) for p, sp in zip(prompts, params)])
        engine = self.llm_engine  # max_tokens beyond max_model_len: cut there (not an error offline), warned once
        for rid, sp in zip(ids, params):
            engine.input_processor.check_max_tokens(engine.requests[rid].num_prompt_tokens, sp.max_tokens, strict=False)
        return ids

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        cartridges: Sequence[str | dict] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in order.

        A prompt is a str, a list of token ids, {"prompt": str} or {"prompt_token_ids": [...]},
        either dict optionally with images and videos (multimodal checkpoints):
        {"multi_modal_data": {"image": PIL image or list, "video": frames or list}}, a video's
        frames a uint8 array [T, H, W, 3] or a list of PIL images, or (frames, {"fps": ...});
        one `<|image_pad|>` / `<|video_pad|>` placeholder per item in the prompt, as the chat
        template writes;
        `sampling_params` is one object for all prompts or a list with one per prompt.
        `cartridges`: KV cartridges every prompt starts after, composed in order (docs/cartridges.md):
        each a path to a `.safetensors` cartridge, an id in `cartridge_dir`, or Tokasaurus's
        {"id": ..., "source": "local"} (or {"path": ...}). A dict prompt may carry its own
        "cartridges" instead.

        Raises:
            ValueError: a bad prompt, parameter or cartridge; nothing is queued then.
        """
        ids = self._add(prompts, sampling_params, cartridges)
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
        cartridges: Sequence[str | dict] | None = None,
    ) -> Iterator[RequestOutput]:
        """Like `generate`, but yields each request's cumulative output every time it grows.
        Closing the iterator early aborts its unfinished requests and frees their blocks."""
        yield from self._run(self._add(prompts, sampling_params, cartridges))

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
