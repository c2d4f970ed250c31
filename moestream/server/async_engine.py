"""`AsyncLLMEngine`: one `LLMEngine` stepped by one background thread, fed from asyncio.

Engine steps are CPU-heavy and blocking, so they run in a dedicated thread, never on the
event loop. Hand-off is by message passing only:

- the event loop puts commands (add a group of requests, abort, stop) on a thread-safe
  queue; the engine thread drains it between steps and blocks on it while idle;
- the engine thread hands each step's outputs back with `loop.call_soon_threadsafe`, and
  the event loop routes them to one `asyncio.Queue` per HTTP request (`RequestStream`).

So every request of every client joins the same continuous batch, the event loop stays
responsive while a step runs, and only the engine thread ever touches the engine (its
scheduler, caches and tokenizer).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from moestream.engine.llm_engine import LLMEngine, PromptType
from moestream.outputs import RequestOutput
from moestream.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed (a step raised, or it was stopped) while a request was in flight."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine figures, copied by the engine thread after every step (safe to read anywhere).

    Attributes:
        num_running: requests in the running batch.
        num_waiting: requests queued in the scheduler, not yet admitted.
        num_blocks: KV cache blocks in all.
        num_free_blocks: KV cache blocks free.
        expert_stats: `LLMEngine.expert_stats()` (hit rate, stall seconds, bytes per tier).
        num_state_slots: hybrid models: device state slots in all (0 for other models).
        num_resident_states, num_swapped_states: requests whose linear-attention state is
            on the device / in host memory.
        num_state_swap_ins: states swapped back in from host so far.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    expert_stats: dict = field(default_factory=dict)
    num_state_slots: int = 0
    num_resident_states: int = 0
    num_swapped_states: int = 0
    num_state_swap_ins: int = 0


def take_snapshot(engine: LLMEngine) -> EngineSnapshot:
    """Copy the engine's figures (call on the engine thread)."""
    pool = engine.state_pool
    return EngineSnapshot(
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        num_blocks=engine.kv_cache.num_blocks,
        num_free_blocks=engine.kv_cache.num_free_blocks,
        expert_stats=engine.expert_stats(),
        num_state_slots=pool.max_resident if pool is not None else 0,
        num_resident_states=pool.num_resident() if pool is not None else 0,
        num_swapped_states=pool.num_swapped() if pool is not None else 0,
        num_state_swap_ins=pool.num_swap_ins if pool is not None else 0,
    )


class OutputObserver(Protocol):
    """Told, on the event loop, about every output routed and every request aborted."""

    def on_output(self, output: RequestOutput, previous: RequestOutput | None) -> None:
        """`output` of one request; `previous` is its last output before this one, if any."""

    def on_abort(self, num_requests: int) -> None:
        """`num_requests` unfinished requests were aborted (client gone)."""


@dataclass
class _Add:
    """Queue `items` (request id, prompt, params) all or none; `done` gets the outcome."""

    items: list[tuple[str, PromptType, SamplingParams]]
    add_special_tokens: bool
    done: concurrent.futures.Future


@dataclass
class _Abort:
    """Abort these engine requests (unknown or finished ones are skipped)."""

    request_ids: list[str]


class _Stop:
    """Abort what is in flight and end the engine thread."""


class RequestStream:
    """Outputs of the engine requests of one HTTP request (n choices of each prompt).

    Iterate it on the event loop: it yields each request's cumulative `RequestOutput` every
    time it grows, and ends when all have finished. Raises EngineError if the engine fails.
    """

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.request_ids = list(request_ids)
        self.unfinished = set(request_ids)
        self.last: dict[str, RequestOutput] = {}
        self.num_without_token = len(self.request_ids)
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self.unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield item


class AsyncLLMEngine:
    """An `LLMEngine` driven by a background thread; the async API of the server.

    Call `start()` on the event loop that will use it, and `await shutdown()` at the end.
    `num_queued` (requests accepted that have not produced their first token yet) is what
    the server's waiting-request limit counts.
    """

    def __init__(self, engine: LLMEngine, observer: OutputObserver | None = None, num_threads: int | None = None) -> None:
        self.engine = engine
        self.num_threads = num_threads
        self.observer = observer
        self.snapshot = take_snapshot(engine)
        self.num_queued = 0
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def tokenizer(self) -> "PreTrainedTokenizerBase":
        """The engine's tokenizer; outside the engine thread, only for chat templates (no encoding)."""
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will await the streams.

        Raises:
            RuntimeError: already started, or no running event loop.
        """
        if self._thread is not None:
            raise RuntimeError("the engine thread is already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="moestream-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread (aborting anything still in flight) and wait for it."""
        if self._thread is None:
            return
        self._inbox.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        for stream in set(self._streams.values()):
            stream._put(EngineError("the server is shutting down"))
        self._streams.clear()

    async def add(
        self, items: Sequence[tuple[str, PromptType, SamplingParams]], add_special_tokens: bool = True
    ) -> RequestStream:
        """Queue engine requests (request id, prompt, params) as one group, all or none.

        `add_special_tokens=False` tokenizes str prompts without BOS & co (chat prompts,
        whose template writes them). Returns the group's stream once the engine thread
        has queued them.

        Raises:
            ValueError: a prompt or a parameter the engine rejects (prompt too long, too many
                logprobs, ...); nothing is queued then.
            EngineError: the engine thread is not running.
        """
        if not self.is_running or self._loop is None:
            raise EngineError("the engine is not running")
        stream = RequestStream([rid for rid, _, _ in items])
        for rid in stream.request_ids:
            self._streams[rid] = stream
        self.num_queued += len(stream.request_ids)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Add(list(items), add_special_tokens, done))
        try:
            await asyncio.wrap_future(done)
        except (ValueError, EngineError):
            self._forget(stream)  # rejected: nothing was queued
            raise
        except BaseException:
            self.abort(stream)  # cancelled (client gone) while being queued: abort what was queued
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Abort the unfinished requests of `stream` at once; the engine thread frees their blocks
        before its next step. No-op for requests already finished."""
        ids = self._forget(stream)
        if ids:
            self._inbox.put(_Abort(ids))
            if self.observer is not None:
                self.observer.on_abort(len(ids))

    # ---- event-loop side ------------------------------------------------------------

    def _forget(self, stream: RequestStream) -> list[str]:
        """Stop routing outputs to `stream`; returns the ids it still had in flight."""
        ids = [rid for rid in stream.request_ids if self._streams.get(rid) is stream]
        for rid in ids:
            del self._streams[rid]
        self.num_queued -= stream.num_without_token
        stream.num_without_token = 0
        return ids

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            previous = stream.last.get(out.request_id)
            if previous is None:  # its first token (or it finished without one)
                stream.num_without_token -= 1
                self.num_queued -= 1
            stream.last[out.request_id] = out
            if out.finished:
                del self._streams[out.request_id]
            if self.observer is not None:
                self.observer.on_output(out, previous)
            stream._put(out)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is not None:
                self._forget(stream)
                stream._put(error)

    # ---- engine thread --------------------------------------------------------------

    def _post(self, fn: Callable[..., None], *args: object) -> None:
        """Run fn(*args) on the event loop (dropped if the loop is closed)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def _run(self) -> None:
        if self.num_threads is not None:
            # torch's intra-op thread count is per thread (OpenMP): set it where the engine runs.
            torch.set_num_threads(self.num_threads)
        engine = self.engine
        stopping = False
        while not stopping:
            commands = []
            if not engine.has_unfinished_requests():
                commands.append(self._inbox.get())  # idle: sleep until there is work
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                if isinstance(cmd, _Add):
                    self._add(cmd)
                elif isinstance(cmd, _Abort):
                    for rid in cmd.request_ids:
                        engine.abort_request(rid)
                else:
                    stopping = True
            if stopping:
                for rid in list(engine.requests):
                    engine.abort_request(rid)
            elif engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as e:  # an engine bug must not hang every client
                    logger.exception("engine step failed; aborting the requests in flight")
                    ids = list(engine.requests)
                    for rid in ids:
                        engine.abort_request(rid)
                    self._post(self._fail, ids, EngineError(f"engine step failed: {e!r}"))
                else:
                    if outputs:
                        self._post(self._dispatch, outputs)
            self.snapshot = take_snapshot(engine)

    def _add(self, cmd: _Add) -> None:
        """Validate every item, then queue them all (nothing is queued on error)."""
        engine = self.engine
        try:
            items = []
            for rid, prompt, params in cmd.items:
                engine.check_params(params)
                if isinstance(prompt, str) and not cmd.add_special_tokens:
                    prompt = {"prompt": prompt,
                              "prompt_token_ids": engine.tokenizer.encode(prompt, add_special_tokens=False)}
                text, ids = engine.tokenize_prompt(prompt)  # tokenized once, here
                if rid in engine.requests:
                    raise ValueError(f"request id '{rid}' is already in flight")
                items.append((rid, {"prompt": text, "prompt_token_ids": ids}, params))
            added = []
            try:
                for rid, prompt, params in items:
                    engine.add_request(prompt, params, rid)
                    added.append(rid)
            except BaseException:
                for rid in added:  # all or none
                    engine.abort_request(rid)
                raise
        except ValueError as e:
            cmd.done.set_exception(e)
        except Exception as e:
            logger.exception("adding a request failed")
            cmd.done.set_exception(EngineError(f"adding the request failed: {e!r}"))
        else:
            cmd.done.set_result(None)
