"""A test-only draft proposer: drafts a reference output's next tokens, right for a chosen
number of positions and wrong after, so tests know exactly which drafts are accepted."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class ScriptedProposer:
    """`propose(token_ids, k)` as the engine's proposers. For the request whose prompt
    starts `token_ids` (the longest of `refs` that does), with n tokens of output so far:
    the reference's tokens n.. for the first `right(prompt index, n)` positions, then
    tokens that differ from the reference's (reference + 1 mod vocab).

    Args:
        refs: (prompt, its greedy reference output) pairs.
        right: (prompt index, output tokens so far) -> positions drafted right.
        vocab_size: for the wrong tokens.
    """

    def __init__(self, refs: Sequence[tuple[list[int], list[int]]], right: Callable[[int, int], int],
                 vocab_size: int) -> None:
        self.refs = list(refs)
        self.right = right
        self.vocab_size = vocab_size
        self.calls = 0

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        self.calls += 1
        i = max((j for j, (p, _) in enumerate(self.refs) if list(token_ids[:len(p)]) == p),
                key=lambda j: len(self.refs[j][0]))
        prompt, ref = self.refs[i]
        n = len(token_ids) - len(prompt)
        r = self.right(i, n)
        wrong = [(t + 1) % self.vocab_size for t in ref[n + r:n + k]]
        return (ref[n:n + r] + wrong)[:k]

    def expected(self, i: int, max_tokens: int, k: int) -> tuple[int, int]:
        """(drafted steps, accepted tokens) for prompt i run alone to `max_tokens` tokens,
        with the engine's room rule (at most max_tokens - n - 1 drafts) and a reference at
        least max_tokens long."""
        drafts = accepted = 0
        n = 1  # the prefill step samples the first token
        while n < max_tokens:
            room = min(k, max_tokens - n - 1)
            a = min(self.right(i, n), room) if room >= 1 else 0
            if room >= 1:
                drafts += 1
                accepted += a
            n += 1 + a
        return drafts, accepted
