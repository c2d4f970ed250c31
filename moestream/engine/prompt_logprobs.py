"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): the raw log-probability of every
prompt token after the first, given the tokens before it, with its rank and the top-N, read
from the same forward pass that computes the prompt (chunk by chunk under chunked prefill).

As vLLM v1 (vllm/v1/worker/gpu_model_runner.py `_get_prompt_logprobs_dict`): the hidden state
of prompt position p gives the logprob of prompt token p + 1; the logits are the model's own
(`compute_logits`, float32), with no penalty, temperature or logits processor applied. A
request that asks for them does not read the prefix cache (`KVCacheCoordinator.find_prefix`),
so every position is computed; its blocks are still cached for others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moestream.engine.request import Request

# Rows whose logits are computed at once: bounds the [rows, vocab] float32 buffer.
PROMPT_LOGPROBS_CHUNK = 512


@dataclass
class PromptLogprobsChunk:
    """The prompt logprobs one step computed for one request.

    Attributes:
        request: the request.
        first: prompt position of the first token scored (>= 1).
        entries: per scored token, [(token id, logprob, rank), then the top-N as
            (token id, logprob, rank)], as the sampler's logprobs; rank is 1-based.
    """

    request: Request
    first: int
    entries: list[list[tuple[int, float, int]]]


def prompt_logprob_spans(scheduled: list[tuple[Request, int]]) -> list[tuple[Request, int, int, int]]:
    """The flat-batch rows whose logits score a prompt token this step: per request that asks
    for prompt logprobs, (request, first row, first prompt position scored, count). A step
    computing positions [s, s + n) of a request scores prompt tokens s + 1 ..
    min(s + n, P - 1) for a P-token prompt."""
    spans = []
    row = 0
    for req, n in scheduled:
        start = req.num_computed_tokens
        if req.sampling_params.prompt_logprobs is not None:
            count = min(start + n, req.num_prompt_tokens - 1) - start
            if count > 0:
                spans.append((req, row, start + 1, count))
        row += n
    return spans


@torch.inference_mode()
def compute_prompt_logprobs(hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            spans: list[tuple[Request, int, int, int]]) -> list[PromptLogprobsChunk]:
    """Prompt logprobs of `spans` (`prompt_logprob_spans`) from the step's hidden states.

    Args:
        hidden: [T, H] the forward's last hidden states (model dtype), one row per scheduled token.
        compute_logits: hidden [R, H] -> logits [R, V] float32 (the model's lm_head).
        spans: (request, first row, first position scored, count).

    Returns:
        One `PromptLogprobsChunk` per span, in order.
    """
    out = []
    for req, row, first, count in spans:
        k = req.sampling_params.prompt_logprobs
        entries: list[list[tuple[int, float, int]]] = []
        for lo in range(0, count, PROMPT_LOGPROBS_CHUNK):
            hi = min(lo + PROMPT_LOGPROBS_CHUNK, count)
            lp = compute_logits(hidden[row + lo: row + hi]).float().log_softmax(dim=-1)  # [r, V]
            targets = torch.tensor(req.token_ids[first + lo: first + hi], dtype=torch.int64, device=lp.device)
            chosen = lp.gather(1, targets[:, None])  # [r, 1]
            ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
            top_v, top_i = lp.topk(min(k, lp.shape[1]), dim=1) if k else (lp[:, :0], lp[:, :0].long())
            for t, c, r, tv, ti in zip(targets.tolist(), chosen[:, 0].tolist(), ranks, top_v.tolist(),
                                       top_i.tolist()):
                entries.append([(t, c, r)] + [(i, v, j + 1) for j, (i, v) in enumerate(zip(ti, tv))])
        out.append(PromptLogprobsChunk(req, first, entries))
    return out
