"""`EngineReplica`: one moestream engine as a Ray Serve deployment. It answers the ingress's
calls with the same serving code as `moestream serve` (`OpenAIServingCompletion`,
`OpenAIServingChat`), and pushes its metrics to the collector."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from moestream.config import EngineConfig
from moestream.engine.llm_engine import LLMEngine
from moestream.server.async_engine import AsyncLLMEngine
from moestream.server.metrics import ServerMetrics
from moestream.server.ray_serve.metrics import PUSH_INTERVAL_S
from moestream.server.serving import APIError, ServerConfig
from moestream.server.serving_chat import OpenAIServingChat
from moestream.server.serving_completion import OpenAIServingCompletion
from moestream.server.serving_tokenization import OpenAIServingTokenization, tokenizer_answer

logger = logging.getLogger("moestream")


def error_body(error: APIError) -> dict:
    """OpenAI's error JSON of `error`."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


class EngineReplica:
    """A Ray Serve deployment class (see `deploy.build_ray_app`): an `LLMEngine` on its own
    engine thread, started with the replica.

    Args:
        engine_config: the engine's settings (as `moestream serve`'s engine flags).
        server_config: the serving settings (model names, limits, media policy).
        collector: the `MetricsCollector` actor handle, or None.
    """

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, collector: Any = None) -> None:
        from ray import serve

        self.metrics = ServerMetrics()
        engine = LLMEngine(engine_config)
        self.async_engine = AsyncLLMEngine(engine, self.metrics, num_threads=server_config.engine_threads)
        self.metrics.bind(lambda: self.async_engine.snapshot, lambda: self.async_engine.num_queued)
        self.serving = {"completion": OpenAIServingCompletion(self.async_engine, server_config),
                        "chat": OpenAIServingChat(self.async_engine, server_config)}
        self.tokenization = OpenAIServingTokenization(self.async_engine, server_config, self.serving["chat"])
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.collector = collector
        self._pusher: asyncio.Task | None = None
        self.async_engine.start()  # Ray Serve runs __init__ on the replica's event loop
        if collector is not None:
            self._pusher = asyncio.get_running_loop().create_task(self._push_metrics())
        logger.info("replica %s: engine started", self.replica_id)

    async def _push_metrics(self) -> None:
        while True:
            try:
                await self.collector.push.remote(self.replica_id, self.metrics.render())
            except Exception:  # the collector is gone (shutting down): try again later
                logger.debug("replica %s: metrics push failed", self.replica_id, exc_info=True)
            await asyncio.sleep(PUSH_INTERVAL_S)

    async def generate(self, kind: str, req: Any) -> tuple[int, dict]:
        """A whole (non-streamed) answer: (HTTP status, JSON body)."""
        serving = self.serving[kind]
        try:
            stream, base = await serving.create(req)
            result = await serving.respond(req, stream, base)
        except APIError as e:
            return e.status, error_body(e)
        return 200, result.model_dump()

    async def tokenizer_call(self, kind: str, req: Any) -> tuple[int, dict]:
        """A tokenizer endpoint's answer (`tokenizer_answer`): (HTTP status, JSON body)."""
        try:
            return 200, await tokenizer_answer(self.tokenization, kind, req)
        except APIError as e:
            return e.status, error_body(e)

    async def generate_stream(self, kind: str, req: Any) -> AsyncIterator[Any]:
        """A streamed answer: first (HTTP status, error body or None), then the SSE events
        (str). Cancelled (client gone), it aborts its engine requests."""
        serving = self.serving[kind]
        try:
            stream, base = await serving.create(req)
        except APIError as e:
            yield e.status, error_body(e)
            return
        yield 200, None
        async for event in serving.events(req, stream, base):  # aborts its requests however it ends
            yield event

    def replica_info(self) -> dict:
        """{"replica": id, "prefix_cache": the engine's prefix-cache figures} (read between steps)."""
        return {"replica": self.replica_id, "prefix_cache": self.async_engine.snapshot.prefix_cache_stats}

    def check_health(self) -> None:
        """Ray Serve's health check: raises when the engine thread has died (the replica is
        then replaced).

        Raises:
            RuntimeError: the engine is not running.
        """
        if not self.async_engine.is_running:
            raise RuntimeError("the engine thread is not running")

    async def __del__(self) -> None:
        if self._pusher is not None:
            self._pusher.cancel()
        if self.collector is not None:
            self.collector.drop.remote(self.replica_id)
        await self.async_engine.shutdown()
