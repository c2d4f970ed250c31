"""POST /v1/completions (as vLLM's serving_completion.py): a batch of prompts x n choices,
answered whole or streamed as server-sent events; `echo` puts the prompt (and with
`logprobs`, its tokens' logprobs) before each choice's text."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from moestream.engine.llm_engine import PromptType
from moestream.outputs import RequestOutput
from moestream.sampling_params import Logprob
from moestream.server.async_engine import RequestStream
from moestream.server.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from moestream.server.serving import OpenAIServing, cartridge_prompt, prompt_logprobs_json, sse, top_logprobs, usage

# What OpenAI's JSON shows for a -inf logprob (vLLM's value): JSON has no infinity.
MIN_LOGPROB = -9999.0


def _prompts(prompt: str | list) -> list[PromptType]:
    """The request's prompts: a str, a list of strs, a list of token ids (one prompt), or a
    list of lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def _top(entry: dict[int, Logprob], token_id: int, n: int) -> dict[str, float]:
    """OpenAI's `top_logprobs` entry: the chosen token's logprob, then the top `n` (OpenAI: "up
    to logprobs + 1 elements"; vLLM the same), by token text, -inf shown as MIN_LOGPROB."""
    top = {(entry[token_id].decoded_token or ""): max(entry[token_id].logprob, MIN_LOGPROB)}
    for _, p in top_logprobs(entry, n):
        top.setdefault(p.decoded_token or "", max(p.logprob, MIN_LOGPROB))
    return top


def _echo_logprobs(out: RequestOutput, n: int, decode: Callable[[list[int]], str], text_len: int
                   ) -> CompletionLogProbs:
    """OpenAI's logprobs of the prompt's tokens (echo): the first token's logprob and top
    logprobs are null (nothing precedes it), then each token's raw logprob and `_top`.
    Text offsets add up the tokens' texts from 0, capped at `text_len` (the prompt text's
    length: a character split over several byte tokens decodes to several '\ufffd'), so
    they never decrease. `decode` gives a token's text where no logprob entry has it."""
    lp = CompletionLogProbs()
    offset = 0
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    for token_id, entry in zip(out.prompt_token_ids, entries):
        if entry is None:
            token = decode([token_id])
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
        else:
            token = entry[token_id].decoded_token or ""
            lp.token_logprobs.append(max(entry[token_id].logprob, MIN_LOGPROB))
            lp.top_logprobs.append(_top(entry, token_id, n))
        lp.tokens.append(token)
        lp.text_offset.append(min(offset, text_len))
        offset += len(token)
    return lp


def _logprobs(out: RequestOutput, start: int, n: int, text_offset: int,
              before: CompletionLogProbs | None = None) -> CompletionLogProbs:
    """OpenAI's completion logprobs of output tokens [start:] (top `n` per position);
    text offsets count from `text_offset` (characters into the choice's text). `before`:
    entries that come first (the echoed prompt's), extended in place."""
    c = out.outputs[0]
    lp = before if before is not None else CompletionLogProbs()
    offset = text_offset
    for token_id, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        chosen = entry[token_id]
        token = chosen.decoded_token or ""
        lp.tokens.append(token)
        lp.token_logprobs.append(chosen.logprob)
        lp.text_offset.append(offset)
        lp.top_logprobs.append(_top(entry, token_id, n))
        offset += len(token)
    return lp


class OpenAIServingCompletion(OpenAIServing):
    """The completion endpoint."""

    async def create(self, req: CompletionRequest) -> tuple[RequestStream, str]:
        """Queue the request's engine requests (choice index = prompt index x n + i, engine
        request id `<id>-<index>`); returns their stream and the response id `<id>`. Then
        `respond` (whole) or `events` (streamed) answers.

        Raises:
            APIError: 404 unknown model, 400 bad value or prompt, 503 overloaded.
        """
        self.check_model(req.model)
        fields = list(type(req).model_fields)
        # echo with logprobs scores the prompt (vLLM: prompt_logprobs defaults to logprobs then);
        # echo with max_tokens 0 samples one token, dropped from the answer (vLLM)
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:  # the echo's top-N needs `logprobs` of them
            prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
        max_tokens = 1 if req.echo_without_generation else req.max_tokens
        params = [self.sampling_params(req, max_tokens, req.logprobs, i, prompt_logprobs) for i in range(req.n)]
        cdir = self.engine.engine.config.cartridge_dir
        prompts = [cartridge_prompt(p, req, cdir) for p in _prompts(req.prompt)]
        base = random_id("cmpl")
        items = [(f"{base}-{p * req.n + i}", prompt, params[i]) for p, prompt in enumerate(prompts)
                 for i in range(req.n)]
        stream = await self.submit(items, True, "prompt", fields, max_tokens)
        return stream, base

    def _prompt_text(self, out: RequestOutput) -> str:
        """The prompt as text: the request's string, or its token ids decoded (as vLLM)."""
        return out.prompt if out.prompt is not None else self.engine.tokenizer.decode(out.prompt_token_ids)

    def _choice(self, req: CompletionRequest, out: RequestOutput, index: int, sent_text: int, sent_tokens: int,
                echoed: int = 0) -> CompletionChoice:
        """Choice `index` from `out`: the text after `sent_text` characters and the logprobs
        of output tokens after `sent_tokens` (whole answer: 0, 0); the echoed prompt and
        `prompt_logprobs` come with the first part of a choice, and later parts' text offsets
        count the `echoed` characters sent before."""
        c = out.outputs[0]
        first = sent_text == 0 and sent_tokens == 0
        echo = req.echo and first
        head = self._prompt_text(out) if echo else ""
        generated = not req.echo_without_generation
        text = head + (c.text[sent_text:] if generated else "")
        lp = None
        if req.logprobs is not None:
            lp = _echo_logprobs(out, req.logprobs, self.engine.tokenizer.decode, len(head)) if echo else None
            if generated:  # offsets index the choice's text: past the echoed prompt
                lp = _logprobs(out, sent_tokens, req.logprobs, len(head) + sent_text + echoed, lp)
            elif lp is None:
                lp = CompletionLogProbs()
        return CompletionChoice(
            index=index, text=text, logprobs=lp, finish_reason=c.finish_reason if generated else
            (None if c.finish_reason is None else "length"), stop_reason=c.stop_reason if generated else None,
            prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs, req.prompt_logprobs)
            if req.prompt_logprobs is not None and first else None)

    async def respond(self, req: CompletionRequest, stream: RequestStream, base: str) -> CompletionResponse:
        """Wait for every choice and build the response."""
        final = await self.final_outputs(stream)
        choices = [self._choice(req, final[rid], index, 0, 0) for index, rid in enumerate(stream.request_ids)]
        return CompletionResponse(id=base, model=self.model_name, choices=choices,
                                  usage=self._usage(req, final, {rid: i // req.n for i, rid in
                                                                 enumerate(stream.request_ids)}))

    @staticmethod
    def _usage(req: CompletionRequest, final: dict[str, RequestOutput], prompt_of: dict[str, int]) -> UsageInfo:
        """`usage` of the answer; echo with max_tokens 0 generated nothing that is returned."""
        u = usage(final, prompt_of)
        if req.echo_without_generation:
            u.total_tokens -= u.completion_tokens
            u.completion_tokens = 0
        return u

    def events(self, req: CompletionRequest, stream: RequestStream, base: str) -> AsyncIterator[str]:
        """The SSE events of a streamed completion: text deltas per choice, the usage chunk
        when `stream_options.include_usage`, then `[DONE]`."""
        return self.stream_events(stream, self._chunks(req, stream, base))

    async def _chunks(self, req: CompletionRequest, stream: RequestStream, base: str) -> AsyncIterator[str]:
        created = int(time.time())
        index = {rid: i for i, rid in enumerate(stream.request_ids)}
        sent_text = dict.fromkeys(stream.request_ids, 0)
        sent_tokens = dict.fromkeys(stream.request_ids, 0)
        echoed: dict[str, int] = {}  # choices whose first part went out -> characters the echo added
        final: dict[str, RequestOutput] = {}
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        async for out in stream:
            rid, c = out.request_id, out.outputs[0]
            delta = c.text[sent_text[rid]:]
            if req.echo_without_generation and not out.finished:
                continue  # the answer is the prompt alone, sent once with the finish reason
            if not delta and not out.finished:
                continue  # held back (a possible stop string): nothing to send yet
            choice = self._choice(req, out, index[rid], sent_text[rid], sent_tokens[rid], echoed.get(rid, 0))
            echoed.setdefault(rid, len(choice.text) - len(delta))  # the first part carries the echo
            sent_text[rid] += len(delta)
            sent_tokens[rid] = len(c.token_ids)
            chunk = CompletionResponse(id=base, created=created, model=self.model_name, choices=[choice])
            yield sse(chunk)
            if out.finished:
                final[rid] = out
        if include_usage:
            u = self._usage(req, final, {rid: i // req.n for rid, i in index.items()})
            yield sse(CompletionResponse(id=base, created=created, model=self.model_name, choices=[], usage=u))
