"""The OpenAI-compatible FastAPI app (as vLLM's entrypoints/openai/api_server.py) and its
uvicorn runner.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health,
/version, /metrics. Every error is answered in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, with its status: 400 (validation, the
field named), 401 (API key), 404 (model or route), 405, 413 (body too large), 503
(too many waiting requests), and 500 only for a server fault, never for bad input.
A client that disconnects or cancels has its engine requests aborted at once.

The app answers from a `ServingBackend`: one engine in this process (`LocalBackend`, what
`moestream serve` runs), or engine replicas on Ray Serve (`moestream.server.ray_serve`),
with the same routes, models, errors and middleware.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any, Protocol

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moestream import __version__
from moestream.engine.llm_engine import LLMEngine
from moestream.server.async_engine import AsyncLLMEngine
from moestream.server.metrics import ServerMetrics
from moestream.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    ParamError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from moestream.server.serving import APIError, ServerConfig, usage
from moestream.server.serving_chat import OpenAIServingChat
from moestream.server.serving_completion import OpenAIServingCompletion
from moestream.server.serving_tokenization import OpenAIServingTokenization, tokenizer_answer

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("moestream.server.requests")

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/version", "/metrics", "/tokenize",
          "/detokenize", "/tokenizer_info")


def _printable(text: str | None) -> str | None:
    """`text` with anything UTF-8 cannot encode (a lone surrogate echoed from a request)
    escaped, so that an error body can always be sent."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(error: APIError) -> JSONResponse:
    """`error` as OpenAI's error JSON with its status (never raises on odd characters)."""
    body = ErrorResponse(error=ErrorInfo(message=_printable(error.message), type=error.type,
                                         param=_printable(error.param), code=error.code))
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    return JSONResponse(body.model_dump(), status_code=error.status, headers=headers)


# pydantic's labels of a union's plain-type branches in error locations (no field has these names).
_BRANCH_LABELS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _field_path(loc: Sequence[Any]) -> str:
    """pydantic's error location as a JSON path: ("body", "messages", 0, "content", "list[...]",
    1, "image_url", "image_url", "url") -> "messages[0].content[1].image_url.url" (union branch
    labels and a tagged union's tag, which repeats the part's first field, left out)."""
    path = ""
    previous: Any = None
    for x in loc:
        if x == "body" or (isinstance(x, str) and ("[" in x or x in _BRANCH_LABELS)):
            continue
        if isinstance(x, int):
            path += f"[{x}]"
        elif x != previous:
            path += ("." if path else "") + x
        previous = x
    return path


def validation_error(errors: Sequence[Any]) -> APIError:
    """A 400 naming the most specific offending field (e.g. "temperature: Input should be ..."
    or "messages[0].content[1].image_url.url: Field required") of pydantic's `errors()`: of a
    union's branches, the error that went deepest."""
    if not errors:
        return APIError(400, "Invalid request body.")
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, ParamError):
        return APIError(400, str(cause), param=cause.param)
    path = _field_path(first.get("loc", ()))
    if first.get("type") == "union_tag_invalid":
        message = f"{path}: unsupported content part type {first['ctx'].get('tag')!r}; use " \
                  f"{first['ctx'].get('expected_tags')}"
    else:
        # pydantic prefixes the messages of our own validators with "Value error, ".
        message = f"{path or 'body'}: {str(first.get('msg', 'invalid value')).removeprefix('Value error, ')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=path or None)


class _GuardMiddleware:
    """ASGI middleware in front of the routes: the API key (401) on /v1/*, the body-size
    limit (413, read before the app sees the body), the HTTP response counter, a 500 for
    any fault that escapes the app (counted like every other response), and the request log
    (`enable_log_requests`)."""

    def __init__(self, app: ASGIApp, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in ROUTES else "other"
        start = time.perf_counter()
        status = 0

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.metrics.on_http_response(path, status)
            await send(message)

        scope.setdefault("state", {})
        try:
            await self._guarded(scope, receive, counting_send)
        except Exception as e:
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if status == 0:  # nothing sent yet: answer 500 (and count it)
                fault = APIError(500, f"Internal server error: {type(e).__name__}", type="server_error")
                with suppress(Exception):
                    await error_response(fault)(scope, receive, counting_send)
        finally:
            if self.config.enable_log_requests:
                log_request(scope, status, time.perf_counter() - start)

    async def _guarded(self, scope: Scope, receive: Receive, counting_send: Send) -> None:
        raw_headers = {k.lower(): v for k, v in scope.get("headers", [])}
        key = self.config.api_key
        if key is not None and scope["path"].startswith("/v1"):
            # Header values are bytes on the wire: compare them with the key's UTF-8 bytes, so
            # that a non-ASCII key can match.
            given = raw_headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {key}".encode("utf-8")):
                error = APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                                 code="invalid_api_key")
                await error_response(error)(scope, receive, counting_send)
                return
        limit = self.config.max_request_body_bytes
        too_large = APIError(413, f"The request body is larger than the limit of {limit} bytes.",
                             code="request_too_large")
        length = raw_headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > limit:
            await error_response(too_large)(scope, receive, counting_send)
            return
        body = bytearray()
        more = scope["method"] not in ("GET", "HEAD")
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                await error_response(too_large)(scope, receive, counting_send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: blocks until the client disconnects

        await self.app(scope, replay, counting_send)


def log_request(scope: Scope, status: int, seconds: float) -> None:
    """One line of the request log (vLLM's --enable-log-requests): method, path, status
    (0: no response was sent, the client left first), request id, prompt and output token
    counts, latency in seconds. Generation routes leave `request_log` in the scope's state."""
    record = scope.get("state", {}).get("request_log")
    rid, tokens = "-", ""
    if record is not None:
        rid, stream, prompt_of = record
        u = usage(stream.last, {r: prompt_of[r] for r in stream.last})
        tokens = f" prompt_tokens={u.prompt_tokens} output_tokens={u.completion_tokens}"
    request_logger.info("%s %s %d request_id=%s%s latency=%.3fs", scope["method"], _printable(scope["path"]),
                        status, rid, tokens, seconds)


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop as soon as the client disconnects (whatever the ASGI
    spec version), then call `on_close` however the response ended."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-send
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()


def find_invalid_unicode(data: Any, path: str = "") -> str | None:
    """The dotted path (e.g. "messages.0.content") of the first string in parsed JSON that is
    not valid Unicode (a lone surrogate such as "\\ud800", which JSON allows and UTF-8 cannot
    encode), or None. Object keys are checked too; "" is the top level."""
    stack: list[tuple[Any, str]] = [(data, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return where
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                at = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and find_invalid_unicode(key) is not None:
                    return at
                stack.append((item, at))
        elif isinstance(value, list):
            stack.extend((item, f"{where}.{i}" if where else str(i)) for i, item in reversed(list(enumerate(value))))
    return None


# A JSON escape of a high surrogate not followed by a low one, of a low one not preceded by a
# high one, or a surrogate's bytes written raw (which json.loads lets through).
_MAYBE_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"  # a high surrogate escape without its low half
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F]"  # a low surrogate escape without its high half
    rb"|\xed[\xa0-\xbf]"  # a surrogate's bytes written raw
)


def body_precheck(max_model_len: int, max_waiting_requests: int) -> Callable[[Any], None]:
    """A check of the parsed JSON body, run before pydantic validates it (validating and
    templating a million items holds the event loop for seconds): refuses at once
    - a `prompt` list so long that it can be neither token ids (max_model_len) nor a batch
      of prompts the waiting limit admits;
    - `messages` with at least max_model_len entries (messages plus content parts): every
      message of a chat template costs at least one token (its role marker).

    Raises (the returned function):
        APIError: 400 naming `prompt` or `messages`.
    """
    limit = max(max_model_len, max_waiting_requests + 1)

    def check(data: Any) -> None:
        if not isinstance(data, dict):
            return
        prompt, messages = data.get("prompt"), data.get("messages")
        if isinstance(prompt, list) and len(prompt) >= limit:
            raise APIError(400, f"prompt: a list of {len(prompt)} items is too long: as token ids the prompt must "
                                f"be under max_model_len ({max_model_len}), and as a batch of prompts it must not "
                                f"exceed the waiting-request limit ({max_waiting_requests})", param="prompt")
        if not isinstance(messages, list):
            return
        count = len(messages)
        if count < max_model_len:
            count += sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
        if count >= max_model_len:
            raise APIError(400, f"messages: {count} messages and content parts cannot fit in max_model_len "
                                f"({max_model_len}) tokens", param="messages")

    return check


async def parse_body(request: Request, model: type[BaseModel] | Callable[[Any], type[BaseModel]],
                     precheck: Callable[[Any], None] | None = None) -> Any:
    """The JSON body validated as `model` (whatever the Content-Type, as OpenAI's API), or
    as the model a function of the parsed JSON picks; `precheck(data)` runs on the parsed
    JSON first and may raise APIError.

    Raises:
        APIError: 400 for a body that is not JSON, holds a string that is not valid Unicode
            (a lone surrogate), or does not validate (the field named).
    """
    body = await request.body()
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"The body is not valid JSON: {e}") from None
    # Scanning the parsed body costs ~0.7 s per million items, so only a body whose raw text
    # may hold a lone surrogate is scanned, off the event loop.
    maybe = (b"\\u" in body or b"\xed" in body) and _MAYBE_SURROGATE.search(body) is not None
    bad = await asyncio.to_thread(find_invalid_unicode, data) if maybe else None
    if bad is not None:
        where = _printable(bad) or "body"
        raise APIError(400, f"{where}: the string is not valid Unicode (it holds a lone UTF-16 surrogate such as "
                            "\\ud800); send UTF-8 text", param=where.split(".")[0])
    if precheck is not None:
        precheck(data)
    if not isinstance(model, type):
        model = model(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    except RecursionError:
        raise APIError(400, "The body is nested too deeply.") from None


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client
    disconnects first. Returns its result, or None after a disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return None
    return task.result()


class ServingBackend(Protocol):
    """Where the app's routes are answered from: one engine in this process (`LocalBackend`),
    or engine replicas on Ray Serve (`moestream.server.ray`)."""

    max_model_len: int

    async def start(self) -> None:
        """At the app's start-up."""

    async def stop(self) -> None:
        """At the app's shutdown."""

    async def is_healthy(self) -> bool:
        """False when no engine can serve (GET /health answers 503)."""

    async def metrics_text(self) -> bytes:
        """The Prometheus text of GET /metrics."""

    async def answer(self, kind: str, req: CompletionRequest | ChatCompletionRequest, request: Request) -> Response:
        """The response to a validated generation request; `kind` is "completion" or "chat".

        Raises:
            APIError: answered in OpenAI's error shape.
        """

    async def tokenizer_call(self, kind: str, req: Any) -> dict[str, Any]:
        """The JSON body of a tokenizer endpoint (`tokenizer_answer`'s kinds).

        Raises:
            APIError: answered in OpenAI's error shape.
        """


class LocalBackend:
    """One `LLMEngine` in this process, stepped by its `AsyncLLMEngine` thread; `metrics` is
    the app's registry (the engine's request metrics and the HTTP counters)."""

    def __init__(self, engine: LLMEngine, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.async_engine = AsyncLLMEngine(engine, metrics, num_threads=config.engine_threads)
        metrics.bind(lambda: self.async_engine.snapshot, lambda: self.async_engine.num_queued)
        self.metrics = metrics
        self.max_model_len = engine.max_model_len
        self.serving = {"completion": OpenAIServingCompletion(self.async_engine, config),
                        "chat": OpenAIServingChat(self.async_engine, config)}
        self.tokenization = OpenAIServingTokenization(self.async_engine, config, self.serving["chat"])

    async def start(self) -> None:
        self.async_engine.start()

    async def stop(self) -> None:
        await self.async_engine.shutdown()
        self.serving["chat"].close()

    async def is_healthy(self) -> bool:
        return self.async_engine.is_running

    async def metrics_text(self) -> bytes:
        return self.metrics.render()

    async def tokenizer_call(self, kind: str, req: Any) -> dict[str, Any]:
        return await tokenizer_answer(self.tokenization, kind, req)

    async def answer(self, kind: str, req: CompletionRequest | ChatCompletionRequest, request: Request) -> Response:
        serving = self.serving[kind]
        created = await until_disconnect(request, serving.create(req))
        if created is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        stream, base = created
        request.state.request_log = (base, stream, {rid: i // req.n for i, rid in enumerate(stream.request_ids)})
        if req.stream:
            return EventStreamResponse(serving.events(req, stream, base), lambda: self.async_engine.abort(stream))
        result = await until_disconnect(request, serving.respond(req, stream, base))
        if result is None:
            return Response(status_code=499)
        return JSONResponse(result.model_dump())


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `engine`. The engine thread starts and stops with the app's
    lifespan; the app has its own metrics registry (`app.state.metrics`) and its
    `AsyncLLMEngine` is `app.state.engine`."""
    metrics = ServerMetrics()
    backend = LocalBackend(engine, config, metrics)
    app = build_openai_app(backend, config, metrics)
    app.state.engine = backend.async_engine
    return app


def build_openai_app(backend: ServingBackend, config: ServerConfig, metrics: ServerMetrics) -> FastAPI:
    """The OpenAI-compatible app over `backend`: the routes, the error shape, the API key /
    body-size / request-log middleware (HTTP counters into `metrics`, `app.state.metrics`)."""
    precheck = body_precheck(backend.max_model_len, config.max_waiting_requests)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            await backend.stop()

    app = FastAPI(title="moestream", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.metrics = metrics
    app.state.backend = backend
    app.add_middleware(_GuardMiddleware, config=config, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                                       code=code))

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"Internal server error: {type(exc).__name__}", type="server_error"))

    @app.get("/health")
    async def health() -> Response:
        if not await backend.is_healthy():
            return error_response(APIError(503, "The engine is not running.", type="server_error"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [ModelCard(id=name, root=config.served_model_names[0], max_model_len=backend.max_model_len)
                 for name in config.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await backend.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        """Body: CompletionRequest."""
        return await backend.answer("completion", await parse_body(request, CompletionRequest, precheck), request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        """Body: ChatCompletionRequest."""
        return await backend.answer("chat", await parse_body(request, ChatCompletionRequest, precheck), request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """Body: TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`)."""
        req = await parse_body(request, lambda d: TokenizeChatRequest if isinstance(d, dict) and
                               d.get("messages") is not None else TokenizeCompletionRequest, precheck)
        return JSONResponse(await backend.tokenizer_call("tokenize", req))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        """Body: DetokenizeRequest."""
        return JSONResponse(await backend.tokenizer_call("detokenize", await parse_body(request, DetokenizeRequest)))

    if config.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info() -> JSONResponse:
            return JSONResponse(await backend.tokenizer_call("tokenizer_info", None))

    return app


class _Server(uvicorn.Server):
    """uvicorn's server, but a SIGINT/SIGTERM ends it with exit code 0 after the graceful
    shutdown (stop accepting, finish in-flight responses, stop the engine) instead of
    re-raising the signal."""

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for `app` (call `.run()`, or `.serve()` in a loop). Binds `host`:`port`."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_keep_alive=5, access_log=False)
    return _Server(config)
