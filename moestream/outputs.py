"""Results handed to users, shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moestream.sampling_params import Logprob

if TYPE_CHECKING:
    from moestream.engine.cartridge_cache import CartridgeRoute


@dataclass
class CompletionOutput:
    """One generated sequence. `logprobs[i]` maps token id -> Logprob for output token i
    (the sampled token and the top-N), or is None when logprobs were not asked for."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timing of one request; times are `time.monotonic()` seconds.

    ttft: seconds from arrival to the first output token. tpot: mean seconds per output
    token after the first (None with fewer than two tokens).
    """

    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.num_generation_tokens < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass
class RequestOutput:
    """A request's output so far (cumulative); `finished` once it has stopped.
    `num_cached_tokens`: prompt tokens found in the prefix cache (not computed), as vLLM.
    `prompt_logprobs` (with `SamplingParams.prompt_logprobs`, as vLLM): per prompt token,
    None for the first, then token id -> Logprob for the prompt token and the top-N; it
    holds the positions computed so far (all of them once the first output token is out)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cartridges: CartridgeRoute | None = None  # the cartridges it named: ids, routing, attached
