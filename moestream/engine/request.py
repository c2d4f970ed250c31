"""A request's state as the scheduler and engine see it.

One rule drives everything (vLLM v1): `num_computed_tokens` advances toward
`num_tokens` = prompt + output tokens. A chunked prefill, a decode and a recompute after
preemption are all "compute the next tokens that are not computed yet".
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
import torch

from moestream.engine.cartridge_cache import PLACEHOLDER_TOKEN, CartridgePrefix, CartridgeRoute
from moestream.engine.detokenizer import IncrementalDetokenizer
from moestream.multimodal.inputs import MultiModalInputs
from moestream.sampling_params import SamplingParams
from moestream.spec_decode.adaptive import DraftState
from moestream.structured_output.backend import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt validated and tokenized once (`InputProcessor.process`), on any path
    (offline, server, Ray): its text (None for token ids), its token ids (multimodal
    placeholders expanded), its multimodal inputs (None for text only) and the cartridges it
    starts after (None for none) with the routing decision of the cartridges it named."""

    prompt: str | None
    prompt_token_ids: list[int]
    mm_inputs: MultiModalInputs | None = None
    cartridge: CartridgePrefix | None = None
    cartridge_route: CartridgeRoute | None = None


@dataclass(eq=False)
class Request:
    """A generation request.

    Attributes:
        token_ids: prompt ids followed by output ids; with cartridges, P placeholder ids
            (`PLACEHOLDER_TOKEN`, never computed) first, so that token i sits at position i.
        cartridge: the cartridges it starts after (P = `num_prefix_tokens` positions), or None.
        num_computed_tokens: tokens whose KV is in the cache.
        generator: the request's own sampler generator when it has a seed, else None.
        spec_token_ids: speculative decoding: draft tokens proposed after its last token,
            verified in its next decode step (not part of `token_ids`).
        draft_state: speculative decoding with adaptive k: its `DraftState` (acceptance
            estimate, draft length, shadow draft).
        mm_inputs: a multimodal prompt's `MultiModalInputs` (images, M-RoPE positions, rope
            delta), None for text.
        cache_salt: mixed into its first KV block's hash (`mm_hash_spans`); b"" for none.
        mm_embeds: vision embeddings of its items (item index -> [length, H]) computed and
            not yet consumed by its prefill (the encoder cache; dropped once the item's
            tokens are computed, computed again after a preemption).
        Times are `time.monotonic()` seconds.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_text: str = ""
    stop_reason: int | str | None = None
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None  # per prompt position (None at 0), filled as computed
    grammar: GrammarMatcher | None = None  # structured outputs: the output's grammar state
    cumulative_logprob: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens to verify in its next step
    draft_state: DraftState | None = None  # set by the speculator (adaptive k)
    num_preemptions: int = 0
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    detokenizer: IncrementalDetokenizer | None = None  # set by the engine
    mm_inputs: MultiModalInputs | None = None  # a prompt with images
    mm_embeds: dict[int, torch.Tensor] = field(default_factory=dict)
    cache_salt: bytes = b""  # vLLM's cache_salt: requests with different salts share no prefix blocks
    cartridge: CartridgePrefix | None = None
    cartridge_route: CartridgeRoute | None = None  # what became of the cartridges it named

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = [PLACEHOLDER_TOKEN] * self.num_prefix_tokens + list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob

    @property
    def mm_hash_spans(self) -> tuple[tuple[int, int, bytes], ...]:
        """(first token, end token, hash): extra keys of the block hashes, each image's content
        hash over its tokens and the `cache_salt` over the first computed token (so that blocks
        computed in an approximate expert mode never serve an exact request, nor the other
        way); with cartridges, each one's file digest over its first position (their blocks
        hold no computed token, so they are the same for every mode)."""
        spans = self.mm_inputs.hash_spans if self.mm_inputs is not None else ()
        salt = self.num_prefix_tokens  # after cartridges, over the first computed position: their blocks are shared
        spans = ((salt, salt + 1, self.cache_salt), *spans) if self.cache_salt else spans
        return (*self.cartridge.hash_spans, *spans) if self.cartridge is not None else spans

    @property
    def num_prefix_tokens(self) -> int:
        """P: the cartridge positions before the prompt (0 without cartridges)."""
        return self.cartridge.num_tokens if self.cartridge is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt's positions, cartridge positions included (`len(prompt_token_ids)` + P)."""
        return self.num_prefix_tokens + len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None
