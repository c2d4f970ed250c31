"""N-gram (prompt lookup) drafts: propose the tokens that followed the first earlier
occurrence of the sequence's last n tokens.

Prompt lookup decoding (Saxena, 2023, github.com/apoorvumang/prompt-lookup-decoding), as
vLLM's NgramProposer (vllm/v1/spec_decode/ngram_proposer.py) configures it: the longest
n in [prompt_lookup_min, prompt_lookup_max] that matches wins, and as in the original the
first match from the start is taken: it is where the prompt holds text the output copies,
and it leaves the most tokens after it (the latest match of a short loop leaves only one
period).
"""

from __future__ import annotations

from collections.abc import Sequence

from moestream.config import SpeculativeConfig


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens for `token_ids` (prompt + output so far), or [] when no suffix
    n-gram with min_n <= n <= max_n occurs earlier in the sequence.

    Raises:
        ValueError: k < 1, min_n < 1 or max_n < min_n.
    """
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n, got k={k}, min_n={min_n}, max_n={max_n}")
    length = len(token_ids)
    tokens = list(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # First start i < length - n with tokens[i:i+n] == suffix (the suffix itself excluded).
        for i in range(length - n):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


class NgramProposer:
    """The `"ngram"` method: `propose(token_ids, k)` drafts with `propose_ngram` under the
    config's prompt_lookup_min / prompt_lookup_max."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` draft tokens following `token_ids` (prompt + output); [] for none."""
        return propose_ngram(token_ids, k, self.min_n, self.max_n)
