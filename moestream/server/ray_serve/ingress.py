"""`OpenAIIngress`: the ingress deployment. It serves `moestream serve`'s FastAPI app
(`build_openai_app`: the same routes, request and response models, errors and middleware)
over a `RayBackend` that sends each generation request to an `EngineReplica` through a
deployment handle (routed by `PrefixAffinityRouter`).

Fault tolerance: a non-streamed request whose replica dies is sent again (up to
`MAX_ATTEMPTS` times, to whichever replica the router picks); a stream whose replica dies
before its first event is sent again, after it ends with an error event and `[DONE]`. When
every attempt fails because no replica is alive, the answer is a 503.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from moestream.server.api import EventStreamResponse, build_openai_app, until_disconnect
from moestream.server.metrics import ServerMetrics
from moestream.server.protocol import ChatCompletionRequest, CompletionRequest
from moestream.server.ray_serve.metrics import ALIVE_WITHIN_S, merge_metrics
from moestream.server.serving import APIError, ServerConfig, sse_error

logger = logging.getLogger("moestream")

# Tries of one request when its replica dies (each one on the replica the router picks then).
MAX_ATTEMPTS = 3
_REPLICA_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
# The ingress's own series (HTTP responses); replicas' copies are left out of the merge.
_INGRESS_ONLY = frozenset({"moestream:http_requests", "moestream:replica_failures"})


def _no_replica(error: BaseException) -> APIError:
    return APIError(503, f"No engine replica could serve the request ({type(error).__name__}); retry later.",
                    type="server_error", code="no_replica")


class RayBackend:
    """`ServingBackend` over engine replicas (a Ray Serve deployment handle).

    Args:
        replicas: handle of the `EngineReplica` deployment.
        max_model_len: the engines' max_model_len (tokens).
        metrics: the ingress's registry (HTTP counters).
        collector: the `MetricsCollector` actor handle, or None.
    """

    def __init__(self, replicas: Any, max_model_len: int, metrics: ServerMetrics, collector: Any = None) -> None:
        self.replicas = replicas
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.collector = collector
        self.replica_failures = Counter(
            "moestream:replica_failures", "Requests whose engine replica died under them, by what the ingress did: "
            "retried (sent again), stream_ended (an error event ended the stream), refused (503, no replica left).",
            ["outcome"], registry=metrics.registry)
        for outcome in ("retried", "stream_ended", "refused"):
            self.replica_failures.labels(outcome)  # at 0 from the start, for alerting rules

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def is_healthy(self) -> bool:
        """True when some replica pushed its metrics in the last ALIVE_WITHIN_S seconds (without
        a collector: always; a request then finds a live replica or 503s)."""
        if self.collector is None:
            return True
        return await self.collector.num_alive.remote(ALIVE_WITHIN_S) > 0

    async def metrics_text(self) -> bytes:
        texts = await self.collector.texts.remote() if self.collector is not None else {}
        return merge_metrics(self.metrics.render(), texts, _INGRESS_ONLY)

    async def tokenizer_call(self, kind: str, req: Any) -> dict[str, Any]:
        """Answered by a replica (its tokenizer and chat template).

        Raises:
            APIError: the replica's error, or 503 when no replica is alive.
        """
        try:
            status, body = await self.replicas.tokenizer_call.remote(kind, req)
        except _REPLICA_GONE as e:
            raise _no_replica(e) from None
        if status != 200:
            err = body["error"]
            raise APIError(status, err["message"], type=err["type"], param=err["param"], code=err["code"])
        return body

    async def answer(self, kind: str, req: CompletionRequest | ChatCompletionRequest, request: Request) -> Response:
        if req.stream:
            def send() -> tuple[Awaitable[Any], Any]:
                gen = self.replicas.options(stream=True).generate_stream.remote(kind, req)
                return gen.__anext__(), gen  # its first item: (status, error body or None)
        else:
            def send() -> tuple[Awaitable[Any], Any]:
                call = self.replicas.generate.remote(kind, req)
                return call, call  # (status, body)
        sent = await self._send(send, request)
        if sent is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        (status, body), handle = sent
        if req.stream and body is None:
            return EventStreamResponse(self._events(handle), handle.cancel)
        return JSONResponse(body, status_code=status)

    async def _send(self, send: Callable[[], tuple[Awaitable[Any], Any]], request: Request) -> tuple[Any, Any] | None:
        """(result, handle) of `send()` = (awaitable, its response or generator handle), sent
        again to another replica when the replica dies first (MAX_ATTEMPTS in all); None when
        the client left (the call is cancelled on the replica, its engine requests aborted).

        Raises:
            APIError: 503 when every attempt met a dead replica.
        """
        error: BaseException | None = None
        for attempt in range(MAX_ATTEMPTS):
            awaitable, handle = send()
            try:
                result = await until_disconnect(request, awaitable)
            except _REPLICA_GONE as e:
                error = e
                self.replica_failures.labels("retried").inc()
                logger.warning("a replica died under a request (attempt %d of %d): %s", attempt + 1, MAX_ATTEMPTS, e)
                continue
            if result is None:
                handle.cancel()
                return None
            return result, handle
        self.replica_failures.labels("refused").inc()
        raise _no_replica(error)  # type: ignore[arg-type]

    async def _events(self, gen: Any) -> AsyncIterator[str]:
        try:
            async for event in gen:
                yield event
        except _REPLICA_GONE as e:
            self.replica_failures.labels("stream_ended").inc()
            yield sse_error(APIError(503, f"The engine replica serving this stream stopped ({type(e).__name__}); "
                                          "send the request again.", type="server_error", code="replica_died"))
            yield "data: [DONE]\n\n"


@serve.ingress()
class OpenAIIngress:
    """The ingress deployment (see `deploy.build_ray_app`): `moestream serve`'s app over
    `RayBackend`."""

    def __init__(self, replicas: Any, server_config: ServerConfig, max_model_len: int, collector: Any = None) -> None:
        self.replicas, self.config, self.max_model_len, self.collector = replicas, server_config, max_model_len, collector

    def __serve_build_asgi_app__(self) -> Any:
        metrics = ServerMetrics()
        return build_openai_app(RayBackend(self.replicas, self.max_model_len, metrics, self.collector), self.config,
                                metrics)
