"""POST /v1/chat/completions (as vLLM's serving_chat.py): the tokenizer's chat template (or
the server's --chat-template) over the messages, n choices, answered whole or streamed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import jinja2

from moestream.outputs import RequestOutput
from moestream.reasoning import get_reasoning_parser
from moestream.sampling_params import SamplingParams
from moestream.server.chat_output import ChatOutputParser
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
    NamedToolChoice,
    TopLogprob,
    random_id,
)
from moestream.server.media import MediaPolicy, open_image, read_image_bytes, url_scheme
from moestream.server.serving import (
    APIError,
    OpenAIServing,
    ServerConfig,
    cartridge_prompt,
    prompt_logprobs_json,
    sse,
    top_logprobs,
    usage,
)
from moestream.server.tool_parsers import NamedFunctionParser, RequiredParser, ToolParser, make_tool_parser, required_schema
from moestream.structured_output.params import StructuredOutputsParams

MIN_LOGPROB = -9999.0  # how -inf logprobs are written (vLLM's clamp)

# Threads decoding images, and threads fetching remote ones (--allowed-media-domains).
MEDIA_THREADS = 4
FETCH_THREADS = 8


def _logprobs(out: RequestOutput, start: int, n: int) -> ChatLogprobs:
    """OpenAI's chat logprobs of output tokens [start:], with the top `n` per position; -inf
    (a token a constraint masked) shown as MIN_LOGPROB (-9999.0, as vLLM: JSON has no inf)."""
    c = out.outputs[0]
    content = []
    for token_id, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        chosen = entry[token_id]
        token = chosen.decoded_token or ""
        content.append(ChatTokenLogprob(
            token=token, logprob=max(chosen.logprob, MIN_LOGPROB), bytes=list(token.encode()),
            top_logprobs=[TopLogprob(token=p.decoded_token or "", logprob=max(p.logprob, MIN_LOGPROB),
                                     bytes=list((p.decoded_token or "").encode())) for _, p in top_logprobs(entry, n)],
        ))
    return ChatLogprobs(content=content)


def _arguments_object(arguments: str) -> Any:
    """A message's tool-call arguments (a JSON string) as an object, when they parse."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _finish_reason(req: ChatCompletionRequest, reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason: "tool_calls" when the model stopped after calling tools on
    its own or under "required"; a named function keeps "stop", as OpenAI and vLLM do."""
    if called and reason == "stop" and not isinstance(req.tool_choice, NamedToolChoice):
        return "tool_calls"
    return reason


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
            message: dict[str, Any] = {"role": m.role, "content": content}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_calls:  # arguments as objects, which templates print with tojson (as vLLM)
                message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                    "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}} for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
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
                messages, chat_template=template, tokenize=False, tools=req.tool_dicts(),
                add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
                **(req.chat_template_kwargs or {}),
            )
        except RecursionError:
            where = "tools" if getattr(req, "tools", None) else (
                "chat_template_kwargs" if getattr(req, "chat_template_kwargs", None) else "messages")
            raise APIError(400, f"The chat template could not be applied: `{where}` is nested too deeply.",
                           param=where) from None
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
        prompt = cartridge_prompt(prompt, req, self.engine.engine.config.cartridge_dir)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = [self._tool_params(req, self.sampling_params(req, max_tokens, logprobs, i)) for i in range(req.n)]
        base = random_id("chatcmpl")
        items = [(f"{base}-{i}", prompt, params[i]) for i in range(req.n)]
        # The template writes the special tokens (BOS & co) itself.
        try:
            stream = await self.submit(items, False, "messages", list(type(req).model_fields), max_tokens)
        except APIError as e:  # a tool's parameters schema that does not compile
            if e.param == "structured_outputs" and req.structured_outputs_params() is None:
                raise APIError(400, f"A tool's parameters schema cannot constrain the output: {e.message}",
                               param="tools") from None
            raise
        return stream, base

    @property
    def reasoning_parser_name(self) -> str | None:
        """The engine's `reasoning_parser`, or None."""
        return self.engine.engine.config.reasoning_parser

    def tool_parser(self, req: ChatCompletionRequest) -> ToolParser | None:
        """The parser of the request's tool calls: by `tool_choice`, "required" and a named
        function read the JSON the output was constrained to, "auto" uses the server's
        --tool-call-parser; None without tools or with "none".

        Raises:
            APIError: 400 for "auto" on a server without --enable-auto-tool-choice.
        """
        choice = req.effective_tool_choice
        if not req.tools or choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return NamedFunctionParser(choice.function.name)
        if choice == "required":
            return RequiredParser()
        if not self.config.enable_auto_tool_choice:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                "set (or send tool_choice \"none\", \"required\" or a named function).",
                           param="tool_choice")
        return make_tool_parser(self.config.tool_call_parser, req.tool_dicts())

    def output_parser(self, req: ChatCompletionRequest, out: RequestOutput) -> ChatOutputParser | None:
        """A parser of one choice's output, or None when neither a reasoning parser nor
        tools are in play (the text is the content as it is). A prompt that closed the
        reasoning (thinking turned off in the template) has no reasoning to parse."""
        tools = self.tool_parser(req)
        name = self.reasoning_parser_name
        reasoning = get_reasoning_parser(name) if name is not None else None
        prompt = out.prompt if isinstance(out.prompt, str) else (out.prompt or {}).get("prompt", "")
        if reasoning is not None and reasoning.ended_in(prompt):
            reasoning = None
        if tools is None and reasoning is None:
            return None
        return ChatOutputParser(reasoning, tools, max_calls=None if req.parallel_tool_calls is not False else 1)

    def _tool_params(self, req: ChatCompletionRequest, params: SamplingParams) -> SamplingParams:
        """`params` with what tools and reasoning need: the output constrained to the call
        ("required": an array of calls; a named function: its parameters), special tokens
        kept where a parser reads them as markers.

        Raises:
            APIError: as `tool_parser`.
        """
        choice = req.effective_tool_choice
        tools = req.tool_dicts()
        so = params.structured_outputs
        if tools and choice == "required":
            so = StructuredOutputsParams(json=required_schema(tools, req.parallel_tool_calls is not False))
        elif tools and isinstance(choice, NamedToolChoice):
            fn = next(t["function"] for t in tools if t["function"]["name"] == choice.function.name)
            so = StructuredOutputsParams(json=fn.get("parameters") or {"type": "object"})
        parser = self.tool_parser(req)
        keep_special = self.reasoning_parser_name is not None or (parser is not None and parser.needs_special_tokens)
        if so is params.structured_outputs and not keep_special:
            return params
        return dataclasses.replace(params, structured_outputs=so,
                                   skip_special_tokens=params.skip_special_tokens and not keep_special)

    async def respond(self, req: ChatCompletionRequest, stream: RequestStream, base: str) -> ChatCompletionResponse:
        """Wait for every choice and build the response."""
        final = await self.final_outputs(stream)
        choices = []
        for i, rid in enumerate(stream.request_ids):
            out = final[rid]
            c = out.outputs[0]
            message, finish_reason = ChatResponseMessage(content=c.text), c.finish_reason
            parser = self.output_parser(req, out)
            if parser is not None:
                m, calls = parser.whole(c.text)
                message = ChatResponseMessage(content=m.content, reasoning_content=m.reasoning, tool_calls=calls)
                finish_reason = _finish_reason(req, c.finish_reason, bool(calls))
            choices.append(ChatChoice(
                index=i, message=message, finish_reason=finish_reason, stop_reason=c.stop_reason,
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
        parsers: dict[str, ChatOutputParser | None] = {}
        final: dict[str, RequestOutput] = {}
        async for out in stream:
            rid, c = out.request_id, out.outputs[0]
            delta = c.text[sent_text[rid]:]
            if not delta and not out.finished:
                continue  # held back (a possible stop string): nothing to send yet
            if rid not in parsers:
                parsers[rid] = self.output_parser(req, out)
            parser, finish_reason = parsers[rid], c.finish_reason
            if parser is None:
                message = DeltaMessage(content=delta)
            else:
                d = parser.delta(c.text, out.finished)
                if not (d.content or d.reasoning or d.tool_calls or out.finished or req.logprobs):
                    continue  # a marker or a partial call: nothing to send yet
                message = DeltaMessage(content=d.content or None, reasoning_content=d.reasoning or None,
                                       tool_calls=d.tool_calls or None)
                if out.finished:  # as the whole response's: calls in the final parse
                    finish_reason = _finish_reason(req, c.finish_reason, parser.num_calls > 0)
            lp = _logprobs(out, sent_tokens[rid], req.top_logprobs or 0) if req.logprobs else None
            sent_text[rid] += len(delta)
            sent_tokens[rid] = len(c.token_ids)
            yield chunk([ChatStreamChoice(index=index[rid], delta=message, logprobs=lp,
                                          finish_reason=finish_reason, stop_reason=c.stop_reason)])
            if out.finished:
                final[rid] = out
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage=usage(final, dict.fromkeys(stream.request_ids, 0)))
