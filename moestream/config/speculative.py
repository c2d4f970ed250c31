"""Speculative decoding settings (`SpeculativeConfig`, vLLM's `speculative_config`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from moestream.validation import is_int

# Draft tokens per step at most: acceptance decays geometrically with the position, and on
# hybrid models each position keeps one linear-attention state per device slot.
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings, as vLLM's `speculative_config`.

    Attributes:
        method: "ngram" (prompt lookup) or "draft_experts" (self-speculation: greedy drafts
            by the model itself with each MoE layer routed only to experts already on the
            device, so a draft never waits for an expert load; DraftExpert, arXiv 2607.24434).
            Or "mtp": the checkpoint's multi-token-prediction layer (`mtp.*` of the Qwen3-Next
            and Qwen3.5 hub checkpoints), chained for k drafts. The prompt_lookup fields apply
            to "ngram" only.
        num_speculative_tokens: draft tokens proposed per step (k), 1 to 16.
        prompt_lookup_min, prompt_lookup_max: n-gram sizes matched, longest first; when one
            is unset it takes the other's value, when both are unset both are 5 (vLLM's rule).
        adaptive: lower each request's draft length, down to 0, where its measured
            acceptance makes drafting slower than plain decode (`spec_decode.adaptive`), and
            raise it again when drafts start to match. False drafts
            `num_speculative_tokens` whenever the method has them, as vLLM.

    Raises:
        ValueError: an unknown method or a bad number.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.method not in ("ngram", "draft_experts", "mtp"):
            raise ValueError(f"unknown speculative method {self.method!r}; use 'ngram', 'draft_experts' or 'mtp'")
        if not is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {self.num_speculative_tokens!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, got "
                             f"{self.num_speculative_tokens}: each draft position costs verify compute (and, on hybrid "
                             "models, one state per slot), and acceptance falls with every position; 3-5 is typical")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        if not (is_int(lo) and is_int(hi) and 1 <= lo <= hi):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, d: "dict | SpeculativeConfig") -> "SpeculativeConfig":
        """From vLLM's dict form, e.g. {"method": "ngram", "num_speculative_tokens": 3}.

        Raises:
            ValueError: not a dict, a missing or unknown key, or a bad value.
        """
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict such as "
                             f'{{"method": "ngram", "num_speculative_tokens": 3}}, got {d!r}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in d:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**d)
