"""The update phase's accept walk: append each request's sampled token and, for a request
with draft tokens, go on to its next row while the token it sampled equals its draft there.

Each output token is still the target model's own sample, drawn one position at a time from
the request's generator as without drafts: greedy output is exact, and so is the sampled
distribution. This is speculative decoding's verification (Leviathan et al. 2023, arXiv
2211.17192) for a draft that is one fixed token per position.

Structured outputs: row j is sampled after the tokens before it were appended, so its
grammar mask is the one of the grammar advanced by those tokens. A draft the grammar forbids
can never equal the sample, so it is rejected, and a rejected draft never reached the
grammar: nothing has to be rolled back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from moestream.engine.request import Request, RequestStatus
from moestream.sampler import SamplerOutput

logger = logging.getLogger(__name__)


class VerifyObserver(Protocol):
    """Told of every judged row: drafts counted, accepted, per position (`Speculator`)."""

    def observe(self, req: Request, j: int, token: int) -> bool:
        """Row j of `req` sampled `token`; returns whether it accepts draft j."""
        ...


def accept_tokens(samplers: list[Request], logits: torch.Tensor, starts: list[int], first: SamplerOutput,
                  sample: Callable[[list[Request], torch.Tensor], SamplerOutput],
                  append_token: Callable[[Request, int, list | None], RequestStatus | None],
                  observer: VerifyObserver | None) -> dict[int, RequestStatus]:
    """Append the sampled tokens of `samplers`, row by row.

    Args:
        samplers: the requests that sample this step; request i's rows are
            logits[starts[i]:starts[i] + 1 + len(its spec_token_ids)].
        logits: [rows, V] float32.
        first: the samples of each request's first row.
        sample: (requests, their logits [n, V]) -> their samples, for the later rows.
        append_token: appends a token (with its logprobs) to a request; returns the status
            it finishes with, or None.
        observer: judges drafts and keeps their statistics (None: no speculative decoding).

    Returns: {index in samplers: the status it finished with}. A request whose logits
    processor raised is aborted (logged), the others go on.
    """
    finished: dict[int, RequestStatus] = {}
    active, result, j = list(range(len(samplers))), first, 0
    while active:
        if j > 0:
            result = sample([samplers[i] for i in active], logits[[starts[i] + j for i in active]])
        verify = []
        for i, token, lps, err in zip(active, result.token_ids, result.logprobs, result.errors):
            req = samplers[i]
            if err is not None:
                logger.error("request %s aborted: its logits processor raised %r", req.request_id, err)
                finished[i] = RequestStatus.FINISHED_ABORTED
                continue
            accepted = observer.observe(req, j, token) if observer is not None else False
            status = append_token(req, token, lps)
            if status is not None:
                finished[i] = status
            elif accepted:
                verify.append(i)
        active, j = verify, j + 1
    return finished
