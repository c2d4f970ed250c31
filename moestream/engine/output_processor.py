"""The update and output phases of a step (as vLLM v1's OutputProcessor and nano-vllm's
scheduler.postprocess): append a sampled token to its request, detokenize it, decide
whether the request stops (`check_stop`, a pure function), and build `RequestOutput`s.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from moestream.engine.detokenizer import find_stop_string
from moestream.engine.prompt_logprobs import PromptLogprobsChunk
from moestream.engine.request import Request, RequestStatus
from moestream.outputs import CompletionOutput, RequestMetrics, RequestOutput
from moestream.sampling_params import Logprob

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def check_stop(req: Request, token: int, eos_token_ids: frozenset[int], max_model_len: int,
               stop_string_hit: tuple[str, int] | None) -> tuple[RequestStatus | None, int | str | None]:
    """(finish status or None, stop reason) of `req` after it sampled `token` (already
    appended): end of sequence unless `ignore_eos`, a stop token id, a stop string
    (`stop_string_hit` = (string, where the text ends), found by the caller), `max_tokens`, or
    `max_model_len` (tokens). Reads only its arguments."""
    sp = req.sampling_params
    if not sp.ignore_eos and token in eos_token_ids:
        return RequestStatus.FINISHED_STOPPED, None
    if token in sp.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED, token
    if stop_string_hit is not None:
        return RequestStatus.FINISHED_STOPPED, stop_string_hit[0]
    if (sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens) or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None, None


class OutputProcessor:
    """Turns sampled tokens into request state and outputs.

    Args:
        tokenizer: decodes logprob tokens (the text itself goes through each request's
            incremental detokenizer).
        eos_token_ids: token ids that end a request unless `ignore_eos`.
        max_model_len: a request stops when it holds this many tokens.
    """

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append_token(self, req: Request, token: int, lps: list[tuple[int, float, int]] | None,
                     now: float) -> RequestStatus | None:
        """Append `token` (with its logprobs: (token id, logprob, rank), sampled token first)
        to `req` at time `now` (monotonic seconds); returns the status it finishes with, or
        None. A stop token's text is left out unless include_stop_str_in_output (vLLM v1)."""
        sp = req.sampling_params
        if req.grammar is not None and not req.grammar.accept(token):  # the sampler masked it: a backend bug
            logger.error("request %s: token %d does not follow its grammar; the grammar state is kept",
                         req.request_id, token)
        req.token_ids.append(token)
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        if lps is not None:
            entry = self.logprob_entry(lps)
            if req.logprobs is None:
                req.logprobs = []
            req.logprobs.append(entry)
            req.cumulative_logprob = (req.cumulative_logprob or 0.0) + lps[0][1]
        stops_on_token = (not sp.ignore_eos and token in self.eos_token_ids) or token in sp.stop_token_ids
        hit = None
        if not stops_on_token or sp.include_stop_str_in_output:
            delta = req.detokenizer.add_token(token)
            req.output_text += delta
            if not stops_on_token and sp.stop:
                hit = find_stop_string(req.output_text, len(delta), sp.stop, sp.include_stop_str_in_output)
                if hit is not None:
                    req.output_text = req.output_text[: hit[1]]
        status, reason = check_stop(req, token, self.eos_token_ids, self.max_model_len, hit)
        if reason is not None:
            req.stop_reason = reason
        return status

    def logprob_entry(self, lps: list[tuple[int, float, int]]) -> dict[int, Logprob]:
        """One position's logprobs as vLLM's dict: the sampled (or prompt) token first, then
        the top-N in rank order (a top token equal to the first is not repeated)."""
        entry: dict[int, Logprob] = {}
        for t, lp, rank in lps:
            if t not in entry:
                entry[t] = Logprob(lp, rank, self.tokenizer.decode([t]))
        return entry

    def add_prompt_logprobs(self, chunks: list[PromptLogprobsChunk]) -> None:
        """Store a step's prompt logprobs on their requests (token texts decoded). Positions a
        request already holds (computed again after a preemption) are kept as they are. With
        cartridges, prompt position 0 follows them and has no logprob either."""
        for c in chunks:
            req = c.request
            for pos, lps in enumerate(c.entries, c.first - req.num_prefix_tokens):
                if pos == len(req.prompt_logprobs):
                    req.prompt_logprobs.append(self.logprob_entry(lps))

    @staticmethod
    def make_output(req: Request) -> RequestOutput:
        """`req`'s cumulative output; while it runs, text that may be the start of a stop
        string is held back (vLLM's stop_buffer_length)."""
        finished = req.status.is_finished
        text = req.output_text
        if not finished and req.sampling_params.stop:
            hold = max(len(s) for s in req.sampling_params.stop) - 1
            text = text[: max(len(text) - hold, 0)]
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
        )
        metrics = RequestMetrics(
            req.arrival_time, req.first_token_time, req.last_token_time, req.finished_time,
            len(req.prompt_token_ids), req.num_output_tokens, req.num_preemptions,
        )
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), [completion], finished, metrics,
                             req.num_cached_tokens or 0,
                             list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
                             req.cartridge_route)
