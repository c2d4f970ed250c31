"""`AsyncLLMEngine`: one `LLMEngine` stepped by one background thread, fed from asyncio.

Engine steps are CPU-heavy and blocking, so they run in a dedicated thread, never on the
event loop. Hand-off is by message passing only:

- the event loop puts commands (add a group of requests, abort, stop) on a thread-safe
  queue; the engine thread drains it between steps and blocks on it while idle;
- the engine thread hands each step's outputs back with `loop.call_soon_threadsafe`, and
  the event loop routes them to one `asyncio.Queue` per HTTP request (`RequestStream`).

So every request of every client joins the same continuous batch, the event loop stays
responsive while a step runs, and only the engine thread ever touches the engine (its
scheduler, caches and detokenizers). Prompts are tokenized before they reach the engine
thread, by one tokenizer worker thread with its own copy of the tokenizer, so a huge
prompt never stalls a step.

Nothing a client does can end the engine thread: a command whose caller has gone is
dropped (and the requests it added are aborted), and every command is guarded. If the
thread dies of its own bug anyway, every stream in flight gets an EngineError, later
adds are refused, and `is_running` (the server's /health) turns false.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from moestream.engine.input_processor import InputProcessor
from moestream.engine.llm_engine import LLMEngine, PromptType
from moestream.engine.request import ProcessedPrompt
from moestream.outputs import RequestOutput
from moestream.sampling_params import SamplingParams
from moestream.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

COMPILE_THREADS = 2  # grammar compiles at once; more wait (and their timeout runs while they wait)
DEFAULT_COMPILE_TIMEOUT = 10.0  # seconds a request waits for its grammar to compile


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
        prefix_cache_stats: `LLMEngine.prefix_cache_stats()` (queries, hits, cached blocks).
        spec_decode_stats: `LLMEngine.spec_decode_stats()` (drafts, draft and accepted tokens).
        kv_groups: per KV cache group, its kind ("full" / "sliding") and the blocks its
            requests hold (`KVCacheCoordinator.kv_group_stats`).
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
    prefix_cache_stats: dict = field(default_factory=dict)
    spec_decode_stats: dict = field(default_factory=dict)
    kv_groups: list = field(default_factory=list)


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
        prefix_cache_stats=engine.prefix_cache_stats(),
        spec_decode_stats=engine.spec_decode_stats(),
        kv_groups=engine.coordinator.kv_group_stats(),
    )


class OutputObserver(Protocol):
    """Told, on the event loop, about every output routed and every request aborted."""

    def on_output(self, output: RequestOutput, previous: RequestOutput | None) -> None:
        """`output` of one request; `previous` is its last output before this one, if any."""

    def on_abort(self, num_requests: int) -> None:
        """`num_requests` unfinished requests were aborted (client gone)."""


@dataclass
class _Add:
    """Queue `items` (request id, tokenized prompt, params) all or none; `done` gets the
    outcome (a cancelled `done` means its caller is gone: the command is dropped)."""

    items: list[tuple[str, dict, SamplingParams]]
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

    Outputs are cumulative, so a newer output of a request replaces one its reader has not
    taken yet: a reader that falls behind (a client that stops reading) holds at most one
    output per request, never a backlog, and gets the text it missed in the next delta.
    """

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.request_ids = list(request_ids)
        self.unfinished = set(request_ids)
        self.last: dict[str, RequestOutput] = {}
        self.num_without_token = len(self.request_ids)
        self._pending: dict[str, RequestOutput] = {}  # request id -> newest output not yet read
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        else:
            self._pending.pop(item.request_id, None)  # keep arrival order: re-insert at the end
            self._pending[item.request_id] = item
        self._ready.set()

    @property
    def num_pending(self) -> int:
        """Outputs waiting for the reader (at most one per request)."""
        return len(self._pending)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self.unfinished:
            if not self._pending and self._error is None:
                self._ready.clear()
                await self._ready.wait()
            if self._pending:
                rid = next(iter(self._pending))
                item = self._pending.pop(rid)
                if item.finished:
                    self.unfinished.discard(rid)
                yield item
            elif self._error is not None:
                raise self._error


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
        self._dead: BaseException | None = None  # why the engine thread ended, if it did not stop cleanly
        # Prompts are encoded by one worker thread with its own tokenizer (a fast tokenizer is
        # not safe to share with the engine thread's detokenizers).
        self.input_processor = InputProcessor(copy.deepcopy(engine.tokenizer), engine.model_config.vocab_size,
                                              engine.max_model_len, engine.mm_processor,
                                              engine.coordinator.cartridges)
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moestream-tokenizer")
        # Grammars compile on their own threads, each waited for at most compile_timeout:
        # a pathological schema never holds up other requests' tokenizing.
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="moestream-grammar")
        self.compile_timeout = float((engine.config.structured_outputs_config or {}).get(
            "compile_timeout", DEFAULT_COMPILE_TIMEOUT))

    @property
    def tokenizer(self) -> "PreTrainedTokenizerBase":
        """The engine's tokenizer; outside the engine thread, only for chat templates (no encoding)."""
        return self.engine.tokenizer

    async def run_tokenizer(self, fn: Callable[["PreTrainedTokenizerBase"], _T]) -> _T:
        """`fn(tokenizer)` on the tokenizer thread, with that thread's own copy of the
        tokenizer (/tokenize, /detokenize): never on the event loop or the engine thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, fn, self.input_processor.tokenizer)

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self._dead is None

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
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        for stream in set(self._streams.values()):
            stream._put(EngineError("the server is shutting down"))
        self._streams.clear()

    async def add(
        self, items: Sequence[tuple[str, PromptType, SamplingParams]], add_special_tokens: bool = True, *,
        requested_max_tokens: int | None = None,
    ) -> RequestStream:
        """Queue engine requests (request id, prompt, params) as one group, all or none.

        Prompts are validated and tokenized first, on the tokenizer thread (an over-long text
        is refused before it is tokenized); `add_special_tokens=False` tokenizes str prompts
        without BOS & co (chat prompts, whose template writes them). `requested_max_tokens`:
        the output tokens the client asked for (None: unset, or a model default); a prompt
        that leaves fewer under max_model_len is refused (`InputProcessor.check_max_tokens`,
        strict), where an unset one just stops at max_model_len. Returns the group's
        stream once the engine thread has queued them. If the caller is cancelled meanwhile
        (client gone), whatever was queued is aborted.

        Raises:
            ValueError: a prompt or a parameter the engine rejects (prompt too long, max_tokens
                beyond max_model_len, too many logprobs, ...); nothing is queued then.
            EngineError: the engine thread is not running.
        """
        if not self.is_running or self._loop is None:
            raise EngineError("the engine is not running")
        # Counted as queued before the first await, so that requests arriving together all
        # see each other in `num_queued` (the server's waiting limit).
        stream = RequestStream([rid for rid, _, _ in items])
        self.num_queued += len(stream.request_ids)
        try:
            loop = asyncio.get_running_loop()
            await self._compile({params.structured_outputs.key: params.structured_outputs
                                 for _, _, params in items if params.structured_outputs is not None})
            prompts = await loop.run_in_executor(self._tokenize_pool, self._tokenize, list(items), add_special_tokens,
                                                 requested_max_tokens)
            if not self.is_running:
                raise EngineError("the engine is not running")
        except BaseException:
            self._forget(stream)
            raise
        for rid in stream.request_ids:
            self._streams[rid] = stream
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Add([(rid, p, params) for (rid, _, params), p in zip(items, prompts)], done))
        if not self.is_running:  # it died just now: nobody will take the command
            _settle(done, EngineError("the engine is not running"))
        try:
            await asyncio.wrap_future(done)
        except (ValueError, EngineError):
            self._forget(stream)  # rejected: nothing was queued
            raise
        except BaseException:
            self.abort(stream)  # cancelled (client gone) while being queued: abort what was queued
            raise
        return stream

    async def _compile(self, constraints: dict[str, StructuredOutputsParams]) -> None:
        """Compile `constraints` (by key) on the grammar threads, so that the engine thread
        finds them cached.

        Raises:
            ValueError: a constraint that does not compile, or not within `compile_timeout`
                seconds (its compile goes on, and caches it, in the background).
        """
        loop = asyncio.get_running_loop()
        for so in constraints.values():
            try:
                await asyncio.wait_for(loop.run_in_executor(self._compile_pool, self.engine.grammar_backend.compile, so),
                                       self.compile_timeout)
            except TimeoutError:
                raise ValueError(f"structured_outputs.{so.kind} did not compile within {self.compile_timeout:g} s; "
                                 "simplify it, or raise compile_timeout in --structured-outputs-config") from None

    def _tokenize(self, items: list[tuple[str, PromptType, SamplingParams]], add_special_tokens: bool,
                  requested_max_tokens: int | None = None) -> list[ProcessedPrompt]:
        """(tokenizer thread) Each item's prompt as a `ProcessedPrompt` (validated and tokenized once)
        (images preprocessed here too, off the engine thread).

        Raises:
            ValueError: a prompt the input processor rejects, or one that leaves fewer than
                `requested_max_tokens` output tokens under max_model_len.
        """
        out: list[ProcessedPrompt] = []
        seen: dict[int, ProcessedPrompt] = {}  # n choices share one prompt object: processed (images included) once
        for _, prompt, _ in items:
            if id(prompt) not in seen:
                text, ids, mm, cart, route = self.input_processor.process(prompt, add_special_tokens)
                num_positions = len(ids) + (cart.num_tokens if cart is not None else 0)
                try:
                    self.input_processor.check_max_tokens(num_positions, requested_max_tokens, strict=True)
                except ValueError as e:
                    if cart is None:
                        raise
                    raise ValueError(f"{e} The input counts the {cart.num_tokens} positions of its cartridges.") from None
                seen[id(prompt)] = ProcessedPrompt(text, ids, mm, cart, route)
            out.append(seen[id(prompt)])
        return out

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
        """The engine thread: commands, then one step, until stopped. A command or a step that
        raises is contained; anything else that ends the loop fails every stream in flight."""
        try:
            if self.num_threads is not None:
                # torch's intra-op thread count is per thread (OpenMP): set it where the engine runs.
                torch.set_num_threads(self.num_threads)
            self._loop_until_stopped()
        except BaseException as e:
            logger.exception("the engine thread failed; the engine is stopped")
            self._die(e)

    def _loop_until_stopped(self) -> None:
        engine = self.engine
        stopping = False
        last_log, logged = time.monotonic(), (0, 0)
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
                if isinstance(cmd, _Stop):
                    stopping = True
                    continue
                try:
                    if isinstance(cmd, _Add):
                        self._add(cmd)
                    else:
                        for rid in cmd.request_ids:
                            engine.abort_request(rid)
                except Exception:  # a command must never end the engine thread
                    logger.exception("an engine command failed")
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
            now = time.monotonic()
            if now - last_log >= STATS_LOG_INTERVAL:
                last_log, logged = now, log_stats(self.snapshot, logged)

    def _die(self, error: BaseException) -> None:
        """(engine thread, on its way out) Refuse new work, fail the commands still queued and
        every stream in flight, so no client waits forever."""
        self._dead = error
        failure = EngineError(f"the engine thread failed: {error!r}")
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                _settle(cmd.done, failure)
        self._post(self._fail_all, failure)

    def _fail_all(self, error: EngineError) -> None:
        for stream in set(self._streams.values()):
            self._forget(stream)
            stream._put(error)

    def _add(self, cmd: _Add) -> None:
        """Validate every item, then queue them all (nothing is queued on error). A command
        whose caller has gone (its future cancelled) is dropped."""
        if not _claim(cmd.done):
            return  # the caller was cancelled before we got here: nothing to add, nobody to tell
        try:
            self.engine.add_requests(cmd.items)
        except ValueError as e:
            _settle(cmd.done, e)
        except Exception as e:
            logger.exception("adding a request failed")
            _settle(cmd.done, EngineError(f"adding the request failed: {e!r}"))
        else:
            _settle(cmd.done, None)


STATS_LOG_INTERVAL = 10.0  # seconds between the engine's periodic stats lines, as vLLM's


def log_stats(snapshot: EngineSnapshot, last: tuple[int, int]) -> tuple[int, int]:
    """Log one line of engine figures (running, waiting, KV cache use, prefix-cache hit rate
    since the last line) when the prefix cache saw queries since then; returns the prefix
    cache's (queries, hits) to pass next time."""
    pc = snapshot.prefix_cache_stats
    queries, hits = pc.get("queries", 0), pc.get("hits", 0)
    if queries > last[0]:
        used = snapshot.num_blocks - snapshot.num_free_blocks
        logger.info("running %d, waiting %d requests; KV cache %.1f%% used; prefix cache hit rate %.1f%% "
                    "(%.1f%% since the last line)", snapshot.num_running, snapshot.num_waiting,
                    100 * used / max(snapshot.num_blocks, 1), 100 * hits / queries,
                    100 * (hits - last[1]) / (queries - last[0]))
    return queries, hits


def _claim(done: concurrent.futures.Future) -> bool:
    """Mark `done` running, so its caller can no longer cancel it; False when it was
    cancelled (the caller is gone) or is settled already."""
    try:
        return done.running() or done.set_running_or_notify_cancel()
    except RuntimeError:  # settled already
        return False


def _settle(done: concurrent.futures.Future, error: BaseException | None) -> None:
    """Give `done` its outcome (None: success); a future already settled or cancelled is
    left as it is (its caller is gone), never an error on the engine thread."""
    if not _claim(done):
        return
    try:
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass
