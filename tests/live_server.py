"""A live `moestream` HTTP server for tests: real uvicorn on a free port of 127.0.0.1, in a
thread of the test process (so tests can look at its engine)."""

from __future__ import annotations

import socket
import threading
import time

import httpx

from moestream.config import EngineConfig
from moestream.engine.llm_engine import LLMEngine
from moestream.server.api import build_app, make_server
from moestream.server.async_engine import AsyncLLMEngine
from moestream.server.serving import ServerConfig


class LiveServer:
    """Serve `engine_config` with `server_config` until `stop()`.

    Attributes:
        base_url: e.g. "http://127.0.0.1:PORT" (add /v1 for the openai client).
        engine: the LLMEngine (read it only while the server is idle).
        async_engine: the AsyncLLMEngine between the app and the engine.
    """

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        self.engine = LLMEngine(engine_config)
        self.config = server_config
        app = build_app(self.engine, server_config)
        self.async_engine: AsyncLLMEngine = app.state.engine
        self.metrics = app.state.metrics
        # proto=IPPROTO_TCP, so that asyncio sets TCP_NODELAY on accepted connections
        # (without it every response with a body waits ~40 ms for a delayed ACK).
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        self._server = make_server(app, "127.0.0.1", port, log_level="warning")
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until the engine has no request in flight and every KV block is free.

        Raises:
            AssertionError: still busy after `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.async_engine.snapshot
            if (not self.engine.requests and s.num_running == 0 and s.num_waiting == 0
                    and s.num_free_blocks == s.num_blocks and self.async_engine.num_queued == 0):
                return
            time.sleep(0.02)
        raise AssertionError(f"engine still busy after {timeout} s: {self.async_engine.snapshot}, "
                             f"{len(self.engine.requests)} requests, {self.async_engine.num_queued} queued")

    def get(self, path: str, **kw: object) -> httpx.Response:
        return httpx.get(self.base_url + path, timeout=30, **kw)

    def post(self, path: str, **kw: object) -> httpx.Response:
        return httpx.post(self.base_url + path, timeout=60, **kw)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()
