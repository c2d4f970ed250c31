"""POST /v1/completions (as vLLM's serving_completion.py): a batch of prompts x n choices,
answered whole or streamed as server-sent events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from moestream.engine.llm_engine import PromptType
from moestream.outputs import RequestOutput
from moestream.server.async_engine import RequestStream
from moestream.server.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from moestream.server.serving import OpenAIServing, sse, top_logprobs, usage


def _prompts(prompt: str | list) -> list[PromptType]:
    """The request's prompts: a str, a list of strs, a list of token ids (one prompt), or a
    list of lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def _logprobs(out: RequestOutput, start: int, n: int, text_offset: int) -> CompletionLogProbs:
    """OpenAI's completion logprobs of output tokens [start:] (top `n` per position);
    text offsets count from `text_offset` (characters into the completion)."""
    c = out.outputs[0]
    lp = CompletionLogProbs()
    offset = text_offset
    for token_id, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        chosen = entry[token_id]
        token = chosen.decoded_token or ""
        lp.tokens.append(token)
        lp.token_logprobs.append(chosen.logprob)
        lp.text_offset.append(offset)
        lp.top_logprobs.append({(p.decoded_token or ""): p.logprob for _, p in top_logprobs(entry, n)})
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
        params = [self.sampling_params(req, req.max_tokens, req.logprobs, i) for i in range(req.n)]
        prompts = _prompts(req.prompt)
        base = random_id("cmpl")
        items = [(f"{base}-{p * req.n + i}", prompt, params[i]) for p, prompt in enumerate(prompts)
                 for i in range(req.n)]
        stream = await self.submit(items, True, "prompt", fields, req.max_tokens)
        return stream, base

    async def respond(self, req: CompletionRequest, stream: RequestStream, base: str) -> CompletionResponse:
        """Wait for every choice and build the response."""
        final = await self.final_outputs(stream)
        choices = []
        for index, rid in enumerate(stream.request_ids):
            out = final[rid]
            c = out.outputs[0]
            choices.append(CompletionChoice(
                index=index, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                logprobs=_logprobs(out, 0, req.logprobs, 0) if req.logprobs is not None else None,
            ))
        return CompletionResponse(id=base, model=self.model_name, choices=choices,
                                  usage=usage(final, {rid: i // req.n for i, rid in enumerate(stream.request_ids)}))

    def events(self, req: CompletionRequest, stream: RequestStream, base: str) -> AsyncIterator[str]:
        """The SSE events of a streamed completion: text deltas per choice, the usage chunk
        when `stream_options.include_usage`, then `[DONE]`."""
        return self.stream_events(stream, self._chunks(req, stream, base))

    async def _chunks(self, req: CompletionRequest, stream: RequestStream, base: str) -> AsyncIterator[str]:
        created = int(time.time())
        index = {rid: i for i, rid in enumerate(stream.request_ids)}
        sent_text = dict.fromkeys(stream.request_ids, 0)
        sent_tokens = dict.fromkeys(stream.request_ids, 0)
        final: dict[str, RequestOutput] = {}
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        async for out in stream:
            rid, c = out.request_id, out.outputs[0]
            delta = c.text[sent_text[rid]:]
            if not delta and not out.finished:
                continue  # held back (a possible stop string): nothing to send yet
            lp = None
            if req.logprobs is not None:
                lp = _logprobs(out, sent_tokens[rid], req.logprobs, sent_text[rid])
            sent_text[rid] += len(delta)
            sent_tokens[rid] = len(c.token_ids)
            chunk = CompletionResponse(
                id=base, created=created, model=self.model_name,
                choices=[CompletionChoice(index=index[rid], text=delta, logprobs=lp, finish_reason=c.finish_reason,
                                          stop_reason=c.stop_reason)],
            )
            yield sse(chunk)
            if out.finished:
                final[rid] = out
        if include_usage:
            u: UsageInfo = usage(final, {rid: i // req.n for rid, i in index.items()})
            yield sse(CompletionResponse(id=base, created=created, model=self.model_name, choices=[], usage=u))
