"""Request handling shared by the completion and chat endpoints (as vLLM's serving_engine.py):
server settings, the API error type, model-name and capacity checks, request fields ->
SamplingParams, queueing the n x prompts engine requests of one HTTP request, SSE framing.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from moestream.engine.llm_engine import PromptType
from moestream.outputs import RequestOutput
from moestream.threads import resolve_threads
from moestream.sampling_params import Logprob, SamplingParams
from moestream.server.async_engine import AsyncLLMEngine, EngineError, RequestStream
from moestream.server.tool_parsers import check_tool_parser
from moestream.server.protocol import (CartridgeUsage, PromptLogprob, PromptLogprobs, PromptTokensDetails,
                                       SamplingRequest, UsageInfo)


@dataclass(frozen=True)
class ServerConfig:
    """Settings of the HTTP layer.

    Attributes:
        served_model_names: names clients may pass as `model`; the first is the one
            responses carry. Any other name is a 404.
        api_key: when set, /v1/* requests need `Authorization: Bearer <api_key>` (else 401).
        max_request_body_bytes: larger request bodies are refused with 413 (bytes).
        max_waiting_requests: a request that would make more than this many engine
            requests wait for their first token is refused with 503 (each of n choices counts).
        chat_template: a Jinja chat template overriding the tokenizer's, or None.
        engine_threads: torch intra-op threads of the engine thread; None = torch's default
            (all cores). `moestream serve` leaves one core to the HTTP event loop on CPU
            (`default_engine_threads`).
        enable_log_requests: log one line per HTTP request (method, path, status, request id,
            prompt and output token counts, latency), as vLLM's `--enable-log-requests`.
        allowed_media_domains: multimodal models: hosts whose http(s) image URLs may be
            fetched (vLLM's flag); empty (default) = the server fetches nothing.
        allowed_local_media_path: multimodal models: directory whose files `file://` image
            URLs may name (vLLM's flag); None (default) = no local files.
        enable_tokenizer_info_endpoint: serve GET /tokenizer_info (vLLM's flag; off by
            default, as it shows the chat template and special tokens).
        tool_call_parser: the model's tool-call format (vLLM's `--tool-call-parser`: hermes,
            deepseek_v3, glm45, kimi_k2, openai), read when `tool_choice` is "auto".
        enable_auto_tool_choice: let requests use `tool_choice` "auto" (vLLM's flag; needs
            `tool_call_parser`). "required" and named functions work without either.
    """

    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_request_body_bytes: int = 10 << 20
    max_waiting_requests: int = 1024
    chat_template: str | None = None
    engine_threads: int | None = None
    enable_log_requests: bool = False
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    enable_tokenizer_info_endpoint: bool = False
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            check_tool_parser(self.tool_call_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, deepseek_v3, glm45, kimi_k2 "
                             "or openai)")
        if self.engine_threads is not None and self.engine_threads < 1:
            raise ValueError(f"engine threads must be at least 1, got {self.engine_threads}")
        if not self.served_model_names or not all(isinstance(n, str) and n for n in self.served_model_names):
            raise ValueError(f"served_model_names must be non-empty strings, got {self.served_model_names!r}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be at least 1, got {self.max_request_body_bytes}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1, got {self.max_waiting_requests}")
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(f"--allowed-local-media-path '{self.allowed_local_media_path}' is not a directory")


def default_engine_threads(device: str) -> int | None:
    """`moestream serve`'s default engine thread count: on CPU, the cores this process may
    run on less one for the HTTP event loop (at least 1), as vLLM's CPU backend reserves a
    core for its API server; None (torch's default) on an accelerator. On 2 shared cores,
    2 engine threads served 28 output tok/s and 1 served 46 (docs/performance.md)."""
    return resolve_threads("auto", device, reserve=1)


class APIError(Exception):
    """An error answered in OpenAI's shape: HTTP `status`, and {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


_FIRST_WORD = re.compile(r"^'?([a-z_]+)")


def bad_request(error: ValueError, fields: Sequence[str], prompt_param: str) -> APIError:
    """A 400 for a ValueError of the engine or SamplingParams; `param` is the field its
    message starts with (e.g. "top_p must be in (0, 1]"), else `prompt_param` when it is
    about the prompt."""
    message = str(error)
    m = _FIRST_WORD.match(message)
    param = m.group(1) if m and m.group(1) in fields else None
    if message.startswith("Requested "):  # vLLM's wording of the max_logprobs checks
        param = "prompt_logprobs" if message.startswith("Requested prompt") else "logprobs"
    if param is None and "prompt" in message:
        param = prompt_param
    return APIError(400, message, param=param)


def top_logprobs(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    """The n most likely (token id, Logprob) of one position, most likely first."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= n), key=lambda x: x[1].rank)[:n]


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None, n: int | None = None
                         ) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` of a response: per position the prompt token, then the top `n`
    (all when None); -inf clamped to -9999.0 as vLLM does (JSON has no inf)."""
    if entries is None:
        return None
    return [None if e is None else {t: PromptLogprob(logprob=max(lp.logprob, -9999.0), rank=lp.rank,
                                                      decoded_token=lp.decoded_token)
                                    for i, (t, lp) in enumerate(e.items()) if i == 0 or n is None or lp.rank <= n}
            for e in entries]


def usage(outputs: dict[str, RequestOutput], prompt_of: dict[str, int]) -> UsageInfo:
    """Usage over the outputs: each distinct prompt counted once (its cached tokens: the most
    any of its choices found in the prefix cache), every choice's tokens; with cartridges,
    `cartridges`: per prompt, their routing decision (None for a prompt without)."""
    prompt_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    routes: dict[int, CartridgeUsage] = {}
    completion = 0
    for rid, out in outputs.items():
        prompt_tokens[prompt_of[rid]] = len(out.prompt_token_ids)
        cached[prompt_of[rid]] = max(cached.get(prompt_of[rid], 0), out.num_cached_tokens)
        completion += len(out.outputs[0].token_ids)
        if out.cartridges is not None:
            routes[prompt_of[rid]] = CartridgeUsage(**out.cartridges.as_dict())
    p = sum(prompt_tokens.values())
    return UsageInfo(prompt_tokens=p, completion_tokens=completion, total_tokens=p + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())),
                     cartridges=[routes.get(i) for i in sorted(prompt_tokens)] if routes else None)


def cartridge_prompt(prompt: PromptType, req: SamplingRequest, cartridge_dir: str | None) -> PromptType:
    """`prompt` with the request's `cartridges` and `cartridge_routing` (a dict prompt), or
    as is without cartridges. Over HTTP a bare string is an id, and a `path` must lie in the
    server's cartridge directory.

    Raises:
        APIError: 400 for a path outside --cartridge-dir (or without one).
    """
    if req.cartridges is None:
        return prompt
    refs = []
    for c in req.cartridges:
        ref = {"id": c} if isinstance(c, str) else c.model_dump(exclude_none=True)
        ref.pop("force_redownload", None)  # over HTTP a file is read again only when it changed (mtime, size)
        path = ref.get("path")
        if path is not None:
            try:
                root = os.path.realpath(cartridge_dir) if cartridge_dir is not None else None
                full = os.path.realpath(os.path.join(root, path)) if root is not None else ""
            except (ValueError, OSError):  # e.g. a NUL byte
                root = None
            if root is None or not full.startswith(root + os.sep):
                raise APIError(400, f"cartridge path {path!r} is not inside the server's cartridge directory "
                                    "(--cartridge-dir); name cartridges by id", param="cartridges")
            ref["path"] = full
        refs.append(ref)
    base = prompt if isinstance(prompt, dict) else {"prompt": prompt} if isinstance(prompt, str) else {
        "prompt_token_ids": list(prompt)}
    return {**base, "cartridges": refs, "cartridge_routing": req.cartridge_routing}


def sse(payload: BaseModel | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def sse_error(error: APIError) -> str:
    """An error event in the middle of a stream (the status was sent already)."""
    body = {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
    return f"data: {json.dumps(body)}\n\n"


class OpenAIServing:
    """What both endpoints share: the engine, the settings, and request intake."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def check_model(self, name: str | None) -> None:
        """Raises APIError 404 when `name` is given and is not a served model name."""
        if name is not None and name not in self.config.served_model_names:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.config.served_model_names)}.",
                           param="model", code="model_not_found")

    def sampling_params(self, req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                        choice: int, prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams of choice `choice` (0-based) of a request. With a seed, choice i
        uses seed + i, so that the n choices differ and choice 0 equals an offline run. A
        field the request leaves unset takes the model's generation_config.json value if it
        has one (as vLLM), else the built-in default. `prompt_logprobs`: when None, the
        request's own field.

        Raises:
            APIError: 400 when SamplingParams rejects a value (the field is named).
        """
        d = self.engine.engine.default_sampling_fields  # the model's generation_config.json, if any

        def pick(value: object, name: str, builtin: object) -> object:
            return value if value is not None else d.get(name, builtin)

        try:
            return SamplingParams(
                temperature=pick(req.temperature, "temperature", 1.0),
                top_p=pick(req.top_p, "top_p", 1.0),
                top_k=pick(req.top_k, "top_k", 0),
                min_p=pick(req.min_p, "min_p", 0.0),
                seed=None if req.seed is None else req.seed + choice,
                max_tokens=pick(max_tokens, "max_tokens", None),
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                logprobs=logprobs,
                prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                logit_bias=req.logit_bias_ids(),
                structured_outputs=req.structured_outputs_params(),
                skip_special_tokens=req.skip_special_tokens,
                expert_mode=req.expert_mode,
            )
        except ValueError as e:
            raise bad_request(e, type(req).model_fields, "prompt") from None

    async def submit(self, items: list[tuple[str, PromptType, SamplingParams]], add_special_tokens: bool,
                     prompt_param: str, fields: Sequence[str], max_tokens: int | None = None) -> RequestStream:
        """Queue the engine requests of one HTTP request, all or none. `max_tokens`: the output
        tokens the request asked for (None: unset), which every prompt must leave room for.

        Raises:
            APIError: 503 when they would exceed the waiting-request limit now; 400 when they
                are more than the limit (they never could be admitted), or when the engine
                rejects a prompt or parameter (e.g. a prompt longer than max_model_len, or
                max_tokens beyond what max_model_len leaves after the prompt); 500 when the
                engine is not running.
        """
        limit = self.config.max_waiting_requests
        if len(items) > limit:
            raise APIError(400, f"This request asks for {len(items)} completions (prompts x n), more than the server's "
                                f"waiting-request limit of {limit} (--max-waiting-requests), so it could never be "
                                "admitted; send fewer prompts or a smaller n.", param="n")
        if self.engine.num_queued + len(items) > limit:
            raise APIError(503, f"The server is overloaded: {self.engine.num_queued} requests are waiting for "
                                f"their first token and the limit is {limit}; retry later.",
                           type="server_error", code="engine_overloaded")
        try:
            return await self.engine.add(items, add_special_tokens, requested_max_tokens=max_tokens)
        except ValueError as e:
            raise bad_request(e, fields, prompt_param) from None
        except EngineError as e:
            raise APIError(500, str(e), type="server_error") from None

    async def final_outputs(self, stream: RequestStream) -> dict[str, RequestOutput]:
        """Wait for every request of `stream` to finish; aborts them if cancelled.

        Raises:
            APIError: 500 when the engine failed meanwhile.
        """
        final: dict[str, RequestOutput] = {}
        try:
            async for out in stream:
                if out.finished:
                    final[out.request_id] = out
        except EngineError as e:
            raise APIError(500, str(e), type="server_error") from None
        finally:
            self.engine.abort(stream)  # no-op for finished requests
        return final

    async def stream_events(self, stream: RequestStream, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """SSE framing around `events`: an error event if the engine fails, then `[DONE]`;
        the stream's requests are aborted however it ends (finished, cancelled, client gone)."""
        try:
            try:
                async for event in events:
                    yield event
            except EngineError as e:
                yield sse_error(APIError(500, str(e), type="server_error"))
            yield "data: [DONE]\n\n"
        finally:
            self.engine.abort(stream)
