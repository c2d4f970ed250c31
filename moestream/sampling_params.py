"""Per-request sampling parameters, named and defaulted as in vLLM (vllm/sampling_params.py)."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moestream.config.engine import EXPERT_MODES
from moestream.structured_output.params import StructuredOutputsParams
from moestream.validation import is_int, is_number

# Temperatures below this are treated as greedy, as vLLM's _SAMPLING_EPS.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token.

    `logprob` is a natural log-probability (<= 0); `rank` is 1-based in the distribution
    (1 = most likely), as vLLM's vllm/logprobs.py Logprob; `decoded_token` is its text, if known.
    """

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class SamplingParams:
    """How to sample one request's output tokens (follows vLLM vllm/sampling_params.py).

    Fields mean what they mean in vLLM: `top_k` 0 or -1 disables top-k; `max_tokens=None`
    means up to max_model_len; `logprobs=N` returns the top-N logprobs (plus the sampled
    token's) per output token; `prompt_logprobs=N` returns, for every prompt token after the
    first, its raw logprob and the top-N (`RequestOutput.prompt_logprobs`; such a request
    does not read the prefix cache, so every position is computed); `logit_bias` maps token
    ids to a number added to their logits before sampling (after the raw logprobs, before the
    penalties, as vLLM v1); `structured_outputs` constrains the output to a JSON schema,
    regex, choice or grammar (`StructuredOutputsParams`); `expert_mode` picks this request's
    expert mode: None = the engine's `expert_mode`, "exact" opts out of an approximate one, and
    an approximate one must be the engine's (docs/expert_modes.md); `logits_processors` are vLLM v0 style callables
    `(output_token_ids so far, logits [V] float32) -> logits [V]`.

    After construction `stop` is a list[str] and `stop_token_ids` a list[int].

    Raises:
        ValueError: a field is out of range; the message names the field, its value and
            the allowed range, e.g. "max_tokens must be at least 1, got 0".
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    expert_mode: str | None = None
    logits_processors: list[Callable[[list[int], torch.Tensor], torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)) and all(is_int(t) for t in self.stop_token_ids):
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        else:
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        if self.logits_processors is not None and not (
            isinstance(self.logits_processors, (list, tuple)) and all(callable(f) for f in self.logits_processors)
        ):
            raise ValueError(f"logits_processors must be a list of callables, got {self.logits_processors!r}")
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, field: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{field} must be {rule}, got {getattr(self, field)!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            check(is_number(getattr(self, name)), name, "a finite number")
        check(self.temperature >= 0.0, "temperature", "non-negative (>= 0)")
        check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        check(is_int(self.top_k) and (self.top_k in (-1, 0) or self.top_k >= 1),
              "top_k", "-1 or 0 (disabled) or at least 1")
        check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", "None or at least 1")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "greater than 0")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]")
        check(self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0),
              "logprobs", "None or an int of at least 0")
        check(self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
              "prompt_logprobs", "None or an int of at least 0")
        check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            is_int(t) and is_number(b) for t, b in self.logit_bias.items())),
            "logit_bias", "None or a dict of token id (int) -> finite number")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "None or a StructuredOutputsParams")
        check(self.seed is None or is_int(self.seed), "seed", "None or an int")
        check(self.expert_mode is None or self.expert_mode in EXPERT_MODES, "expert_mode",
              f"None or one of {', '.join(EXPERT_MODES)}")
        check(all(isinstance(s, str) and s != "" for s in self.stop), "stop", "a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        """True when the temperature is (near) zero, so sampling is argmax, as vLLM (< 1e-5)."""
        return self.temperature < SAMPLING_EPS

