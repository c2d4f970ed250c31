"""POST /v1/chat/completions (as vLLM's serving_chat.py): the tokenizer's chat template (or
the server's --chat-template) over the messages, n choices, answered whole or streamed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator
from typing import Any

import jinja2

from moestream.outputs import RequestOutput
from moestream.server.async_engine import AsyncLLMEngine, RequestStream
from moestream.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    ImageContentPart,
    TopLogprob,
    random_id,
)
from moestream.server.media import MediaPolicy, open_image, read_image_bytes, url_scheme
from moestream.server.serving import (
    APIError,
    OpenAIServing,
    ServerConfig,
    prompt_logprobs_json,
    sse,
    top_logprobs,
    usage,
)

# Threads decoding images, and threads fetching remote ones (--allowed-media-domains).
MEDIA_THREADS = 4
FETCH_THREADS = 8


def _logprobs(out: RequestOutput, start: int, n: int) -> ChatLogprobs:
    """OpenAI's chat logprobs of output tokens [start:], with the top `n` per position."""
    c = out.outputs[0]
    content = []
    for token_id, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        chosen = entry[token_id]
        token = chosen.decoded_token or ""
        content.append(ChatTokenLogprob(
            token=token, logprob=chosen.logprob, bytes=list(token.encode()),
            top_logprobs=[TopLogprob(token=p.decoded_token or "", logprob=p.logprob,
                                     bytes=list((p.decoded_token or "").encode())) for _, p in top_logprobs(entry, n)],
        ))
    return ChatLogprobs(content=content)


class OpenAIServingChat(OpenAIServing):
    """The chat completion endpoint. Images of `image_url` parts are read and decoded on two
    bounded thread pools (remote fetches, decoding), off the event loop."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        super().__init__(engine, config)
        self._media_pool = concurrent.futures.ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="moestream-media")
        self._fetch_pool = concurrent.futures.ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="moestream-fetch")

    def render(self, req: ChatCompletionRequest) -> tuple[str, list[tuple[str, str]]]:
        """The prompt text (the chat template applied to the messages, each image part given
        to it as {"type": "image"}, which Qwen-VL templates turn into a vision placeholder)
        and the image parts in order, as (where, url).

        Raises:
            APIError: 400 when there is no chat template, the template rejects the messages
                (e.g. roles that do not alternate), or images are sent to a model that takes
                none or more than its per-prompt limit.
        """
        tokenizer = self.engine.tokenizer
        template = self.config.chat_template
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "This model's tokenizer has no chat template; use /v1/completions, or start the "
                                "server with --chat-template.", param="messages")
        messages = []
        images: list[tuple[str, str]] = []
        for i, m in enumerate(req.messages):
            content: str | list[dict]
            if isinstance(m.content, str) or m.content is None:
                content = m.content or ""
            elif not any(isinstance(part, ImageContentPart) for part in m.content):
                content = "\n".join(part.text for part in m.content)  # type: ignore[union-attr]
            else:
                content = []
                for j, part in enumerate(m.content):
                    if isinstance(part, ImageContentPart):
                        images.append((f"messages[{i}].content[{j}]", part.image_url.url))
                        content.append({"type": "image"})
                    else:
                        content.append({"type": "text", "text": part.text})
            message = {"role": m.role, "content": content}
            if m.name is not None:
                message["name"] = m.name
            messages.append(message)
        if images:
            mm = self.engine.engine.mm_processor
            if mm is None:
                raise APIError(400, "This model takes no images (its checkpoint has no vision tower); send text only.",
                               param=images[0][0])
            limit = mm.limit_per_prompt["image"]
            if len(images) > limit:
                raise APIError(400, f"The messages have {len(images)} images, over the limit of {limit} per prompt "
                                    "(--limit-mm-per-prompt).", param=images[limit][0])
        try:
            prompt = tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False,
                add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
            )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
            raise APIError(400, f"The chat template could not be applied to the messages: {e}", param="messages") from None
        if not isinstance(prompt, str):
            raise APIError(400, "The chat template did not render to text.", param="messages")
        return prompt, images

    async def load_images(self, images: list[tuple[str, str]]) -> list:
        """Decoded PIL images of the (where, url) parts, each checked (pixels, aspect ratio)
        before its pixels are decoded. Remote fetches run on their own bounded thread pool,
        decoding on another, so a slow image host never holds up inline images.

        Raises:
            APIError: 400 naming the part: a malformed or refused URL, data that is not an
                image, or an image over the pixel limit or too thin.
        """
        policy = MediaPolicy(self.config.allowed_media_domains, self.config.allowed_local_media_path,
                             self.config.max_request_body_bytes)
        loop = asyncio.get_running_loop()
        out = []
        for where, url in images:
            remote = url_scheme(url) in ("http", "https")
            try:
                data = await loop.run_in_executor(self._fetch_pool if remote else self._media_pool, read_image_bytes,
                                                  url, policy, where)
                out.append(await loop.run_in_executor(self._media_pool, self._decode, data, where))
            except ValueError as e:
                raise APIError(400, str(e), param=where) from None
        return out

    def _decode(self, data: bytes, where: str) -> Any:
        """(media thread) open, check against the model's limits, decode.

        Raises:
            ValueError: see `open_image` and `MultiModalProcessor.check_image`, or pixels
                that cannot be decoded.
        """
        image = open_image(data, where)
        self.engine.engine.mm_processor.check_image(image, where)
        try:
            image.load()  # decoded here, so that a corrupt image is named by its part
        except Exception as e:  # Pillow: OSError (truncated), SyntaxError, ValueError, ...
            raise ValueError(f"{where} cannot be decoded: {' '.join(str(e).split())}") from None
        return image

    def close(self) -> None:
        """Stop the media thread pools (at shutdown)."""
        self._media_pool.shutdown(wait=False, cancel_futures=True)
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)

    async def create(self, req: ChatCompletionRequest) -> tuple[RequestStream, str]:
        """Queue the n choices (engine request ids `<id>-<i>`); returns their stream and the
        response id `<id>`. Then `respond` (whole) or `events` (streamed) answers.

        Raises:
            APIError: 404 unknown model, 400 bad value or messages, 503 overloaded.
        """
        self.check_model(req.model)
        text, image_parts = self.render(req)
        prompt: str | dict = text
        if image_parts:  # URLs may be fetched (when allowed): off the event loop
            images = await self.load_images(image_parts)
            prompt = {"prompt": text, "multi_modal_data": {"image": images}}
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = [self.sampling_params(req, max_tokens, logprobs, i) for i in range(req.n)]
        base = random_id("chatcmpl")
        items = [(f"{base}-{i}", prompt, params[i]) for i in range(req.n)]
        # The template writes the special tokens (BOS & co) itself.
        stream = await self.submit(items, False, "messages", list(type(req).model_fields), max_tokens)
        return stream, base

    async def respond(self, req: ChatCompletionRequest, stream: RequestStream, base: str) -> ChatCompletionResponse:
        """Wait for every choice and build the response."""
        final = await self.final_outputs(stream)
        choices = []
        for i, rid in enumerate(stream.request_ids):
            out = final[rid]
            c = out.outputs[0]
            choices.append(ChatChoice(
                index=i, message=ChatResponseMessage(content=c.text), finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                logprobs=_logprobs(out, 0, req.top_logprobs or 0) if req.logprobs else None,
            ))
        first = final[stream.request_ids[0]]  # every choice has the same prompt
        return ChatCompletionResponse(id=base, model=self.model_name, choices=choices,
                                      usage=usage(final, dict.fromkeys(stream.request_ids, 0)),
                                      prompt_logprobs=prompt_logprobs_json(first.prompt_logprobs, req.prompt_logprobs))

    def events(self, req: ChatCompletionRequest, stream: RequestStream, base: str) -> AsyncIterator[str]:
        """The SSE events of a streamed chat completion: a role chunk per choice, content
        deltas, the usage chunk when `stream_options.include_usage`, then `[DONE]`."""
        return self.stream_events(stream, self._chunks(req, stream, base))

    async def _chunks(self, req: ChatCompletionRequest, stream: RequestStream, base: str) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], **kw: object) -> str:
            return sse(ChatCompletionChunk(id=base, created=created, model=self.model_name, choices=choices, **kw))

        index = {rid: i for i, rid in enumerate(stream.request_ids)}
        for i in range(req.n):
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        sent_text = dict.fromkeys(stream.request_ids, 0)
        sent_tokens = dict.fromkeys(stream.request_ids, 0)
        final: dict[str, RequestOutput] = {}
        async for out in stream:
            rid, c = out.request_id, out.outputs[0]
            delta = c.text[sent_text[rid]:]
            if not delta and not out.finished:
                continue  # held back (a possible stop string): nothing to send yet
            lp = _logprobs(out, sent_tokens[rid], req.top_logprobs or 0) if req.logprobs else None
            sent_text[rid] += len(delta)
            sent_tokens[rid] = len(c.token_ids)
            yield chunk([ChatStreamChoice(index=index[rid], delta=DeltaMessage(content=delta), logprobs=lp,
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
            if out.finished:
                final[rid] = out
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage=usage(final, dict.fromkeys(stream.request_ids, 0)))
