"""Regression tests of the server hardening: clients that give up while their request is
being queued never end the engine thread; over-long prompts are refused before they are
tokenized, and tokenizing happens off the engine thread; lone surrogates are 400s; 500s are
counted; /v1/models hides the checkpoint path; non-ASCII API keys match; a reader that
falls behind holds one output per request; n over the waiting limit is a 400; the request
log."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import random
import threading
import time
import weakref
from collections.abc import Iterator

import httpx
import pytest
from conftest import API_KEY, SERVED_MODEL, SERVER_MAX_MODEL_LEN
from live_server import LiveServer
from prometheus_client.parser import text_string_to_metric_families

from moestream import LLM, SamplingParams
from moestream.config import EngineConfig
from moestream.engine.input_processor import InputProcessor
from moestream.outputs import CompletionOutput, RequestOutput
from moestream.server.async_engine import RequestStream, _Add
from moestream.server.serving import OpenAIServing, ServerConfig

AUTH = {"Authorization": f"Bearer {API_KEY}"}
UNICODE_KEY = "clé-ü-密钥"


def _counter(server: LiveServer, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


# ---- 1. a client that gives up while being queued never ends the engine thread ----------------


def test_a_cancelled_add_command_is_dropped_not_fatal(live_server: LiveServer) -> None:
    """The engine thread's handling of an add whose caller was cancelled: before the fix,
    set_result on the cancelled future raised InvalidStateError and ended the thread."""
    engine = live_server.async_engine
    live_server.wait_idle()
    prompt = {"prompt": "hi", "prompt_token_ids": [5, 6, 7]}
    gone: concurrent.futures.Future = concurrent.futures.Future()
    assert gone.cancel()
    engine._add(_Add([("gone-0", prompt, SamplingParams(max_tokens=1))], gone))  # must not raise
    assert "gone-0" not in live_server.engine.requests and gone.cancelled()
    # A caller cancelled after the engine took the command: the outcome is set, and the
    # caller's abort (which follows in the inbox) removes the request.
    taken: concurrent.futures.Future = concurrent.futures.Future()
    assert taken.set_running_or_notify_cancel()
    engine._add(_Add([("taken-0", prompt, SamplingParams(max_tokens=1))], taken))
    assert taken.result(timeout=0) is None
    live_server.engine.abort_request("taken-0")
    assert engine.is_running


def test_hundreds_of_clients_giving_up_mid_flight_leave_the_engine_alive(live_server: LiveServer) -> None:
    url = live_server.base_url + "/v1/completions"
    long_body = {"model": SERVED_MODEL, "prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True,
                 "temperature": 0, "stream": True}
    short_body = {"model": SERVED_MODEL, "prompt": "hi there", "max_tokens": 1, "temperature": 0}
    before = live_server.post("/v1/completions", json={**short_body, "max_tokens": 8}, headers=AUTH).json()
    rng = random.Random(0)

    async def impatient(http: httpx.AsyncClient, i: int) -> None:
        timeout = httpx.Timeout(rng.uniform(0.001, 0.05))  # gives up somewhere between connect and answer
        try:
            await http.post(url, json={**short_body, "prompt": f"hi {i}"}, headers=AUTH, timeout=timeout)
        except httpx.HTTPError:
            pass

    async def run() -> str:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=400)) as http:
            async with http.stream("POST", url, json=long_body, headers=AUTH) as r:
                assert r.status_code == 200
                text, lines = [], r.aiter_lines()
                first = await lines.__anext__()
                for batch in range(6):
                    await asyncio.gather(*(impatient(http, batch * 50 + i) for i in range(50)))
                    assert live_server.async_engine.is_running, f"engine thread died in batch {batch}"
                async for line in lines:
                    if line.startswith("data: {"):
                        text.append(line)
                return first + "".join(text)

    streamed = asyncio.run(run())
    assert '"finish_reason":"length"' in streamed  # the long stream completed
    assert live_server.async_engine.is_running and live_server.get("/health").status_code == 200
    after = live_server.post("/v1/completions", json={**short_body, "max_tokens": 8}, headers=AUTH).json()
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    live_server.wait_idle()


# ---- 2. over-long prompts are refused before tokenizing; tokenizing is off the engine thread ----


def test_length_is_checked_before_tokenizing(offline_llm: LLM) -> None:
    tok = offline_llm.get_tokenizer()
    calls: list[int] = []

    class CountingTokenizer:
        def get_vocab(self) -> dict[str, int]:
            return tok.get_vocab()

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            calls.append(len(text))
            return tok.encode(text, add_special_tokens=add_special_tokens)

    proc = InputProcessor(CountingTokenizer(), len(tok), max_model_len=128)
    longest = max(len(t) for t in tok.get_vocab())
    assert proc.max_token_chars == longest
    huge = "x" * (128 * longest)  # at least 128 tokens whatever the text is
    with pytest.raises(ValueError, match=r"at least 128 tokens .*max_model_len is 128"):
        proc.process(huge)
    assert calls == []  # refused without tokenizing
    # Just under the bound it is tokenized (and then judged by its real length).
    proc.process("x" * 10)
    assert calls == [10]
    # A million token ids are refused by their count, before any id is looked at.
    with pytest.raises(ValueError, match=r"The decoder prompt \(1000000 tokens\) is longer than the maximum model length of 128"):
        proc.process([None] * 1_000_000)


def test_server_tokenizes_off_the_engine_thread(live_server: LiveServer) -> None:
    proc = live_server.async_engine.input_processor
    assert proc.tokenizer is not live_server.engine.tokenizer  # its own copy
    threads: list[str] = []
    encode = proc.tokenizer.encode

    def spy(text: str, **kw: object) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(text, **kw)

    proc.tokenizer.encode = spy
    try:
        r = live_server.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": "def f(x):", "max_tokens": 1},
                             headers=AUTH)
        assert r.status_code == 200
        too_long = "y" * (SERVER_MAX_MODEL_LEN * proc.max_token_chars)
        r = live_server.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": too_long}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "characters, so at least" in r.json()["error"]["message"]
    finally:
        del proc.tokenizer.encode
    assert len(threads) == 1 and threads[0].startswith("moestream-tokenizer")


# ---- 3. lone surrogates are a 400 naming the field; every 500 is counted ------------------------

SURROGATE_BODIES = [
    ("/v1/completions", '{"model": "\\ud800", "prompt": "hi"}', "model"),
    ("/v1/completions", '{"model": "%s", "prompt": "a\\ud800b"}' % SERVED_MODEL, "prompt"),
    ("/v1/completions", '{"model": "%s", "prompt": ["ok", "\\udfff"]}' % SERVED_MODEL, "prompt"),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % SERVED_MODEL,
     "messages"),
    ("/v1/completions", '{"model": "%s", "prompt": "hi", "stop": ["\\udc00"]}' % SERVED_MODEL, "stop"),
    ("/v1/completions", '{"model": "%s", "prompt": "hi", "\\ud800": 1}' % SERVED_MODEL, "\\ud800"),
]


@pytest.mark.parametrize("path,body,param", SURROGATE_BODIES)
def test_lone_surrogate_is_a_400_naming_the_field(live_server: LiveServer, path: str, body: str, param: str) -> None:
    before = _counter(live_server, "moestream:http_requests_total", path=path, status="400")
    r = live_server.post(path, content=body.encode(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "not valid Unicode" in error["message"]
    assert _counter(live_server, "moestream:http_requests_total", path=path, status="400") == before + 1
    assert live_server.get("/health").status_code == 200


def test_raw_surrogate_bytes_and_valid_pairs(live_server: LiveServer) -> None:
    headers = {**AUTH, "Content-Type": "application/json"}
    raw = b'{"model": "%s", "prompt": "a\xed\xa0\x80b", "max_tokens": 1}' % SERVED_MODEL.encode()
    r = live_server.post("/v1/completions", content=raw, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    pair = '{"model": "%s", "prompt": "smile \\ud83d\\ude00", "max_tokens": 1}' % SERVED_MODEL
    assert "\\ud83d\\ude00" in pair  # an escaped surrogate pair: valid Unicode
    r = live_server.post("/v1/completions", content=pair.encode(), headers=headers)
    assert r.status_code == 200, r.text


def test_a_huge_prompt_list_is_refused_before_validation(live_server: LiveServer) -> None:
    """A list longer than both max_model_len and the waiting limit is neither a prompt nor an
    admissible batch: 400 before pydantic sees it (the body limit here is 64 KiB, so 20k ids)."""
    body = {"model": SERVED_MODEL, "prompt": [1] * 20_000, "max_tokens": 1}
    r = live_server.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["message"].startswith("prompt: a list of 20000 items is too long")
    # Just under the bound it is validated as usual (and refused as too long a prompt).
    r = live_server.post("/v1/completions", json={**body, "prompt": [1] * 200}, headers=AUTH)
    assert r.status_code == 400 and "max_model_len is 128" in r.json()["error"]["message"]


def test_a_chat_with_more_messages_than_tokens_is_refused_before_validation(live_server: LiveServer) -> None:
    messages = [{"role": "user", "content": "a"}] * SERVER_MAX_MODEL_LEN
    r = live_server.post("/v1/chat/completions", json={"model": SERVED_MODEL, "messages": messages}, headers=AUTH)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages" and error["message"] == (
        f"messages: {SERVER_MAX_MODEL_LEN} messages and content parts cannot fit in max_model_len "
        f"({SERVER_MAX_MODEL_LEN}) tokens")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}] * 100}, {"role": "user", "content": "b"}] * 2
    r = live_server.post("/v1/chat/completions", json={"model": SERVED_MODEL, "messages": parts}, headers=AUTH)
    assert r.status_code == 400 and "204 messages and content parts" in r.json()["error"]["message"]


def test_a_fault_is_a_counted_500(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*args: object, **kw: object) -> None:
        raise RuntimeError("boom \ud800")  # a message UTF-8 cannot encode, as an echoed input would be

    before = _counter(live_server, "moestream:http_requests_total", path="/v1/completions", status="500")
    monkeypatch.setattr(live_server.async_engine, "add", broken)
    # The server logs the traceback (stderr writes the surrogate escaped); a captured record
    # holding it cannot be sent between pytest-xdist processes, so the log is muted here.
    monkeypatch.setattr(logging.getLogger("moestream.server.api"), "disabled", True)
    r = live_server.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": "hi"}, headers=AUTH)
    monkeypatch.undo()
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert _counter(live_server, "moestream:http_requests_total", path="/v1/completions", status="500") == before + 1
    assert live_server.async_engine.is_running


# ---- 7. /v1/models shows the served name, never the checkpoint path ------------------------------


def test_models_root_is_the_served_name(live_server: LiveServer) -> None:
    data = live_server.get("/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m["root"]) for m in data] == [(SERVED_MODEL, SERVED_MODEL), ("alias", SERVED_MODEL)]
    assert str(live_server.engine.config.model) not in live_server.get("/v1/models", headers=AUTH).text


# ---- a second server: non-ASCII key, waiting limit 2, request log --------------------------------


@pytest.fixture(scope="module")
def logged_server(qwen3_moe_dir: str) -> Iterator[LiveServer]:
    server = LiveServer(
        EngineConfig(model=qwen3_moe_dir, dtype="float32", max_model_len=SERVER_MAX_MODEL_LEN, max_num_seqs=4),
        ServerConfig(served_model_names=("m",), api_key=UNICODE_KEY, max_waiting_requests=2,
                     enable_log_requests=True),
    )
    yield server
    server.stop()


def test_non_ascii_api_key_matches_its_utf8_bytes(logged_server: LiveServer) -> None:
    good = {"Authorization": b"Bearer " + UNICODE_KEY.encode("utf-8")}
    assert logged_server.get("/v1/models", headers=good).status_code == 200
    latin1 = {"Authorization": b"Bearer " + UNICODE_KEY.encode("utf-8").decode("latin-1").encode("utf-8")}
    assert logged_server.get("/v1/models", headers=latin1).status_code == 401
    assert logged_server.get("/v1/models", headers={"Authorization": "Bearer cle"}).status_code == 401


def test_n_over_the_waiting_limit_is_a_400(logged_server: LiveServer) -> None:
    key = {"Authorization": b"Bearer " + UNICODE_KEY.encode("utf-8")}
    r = logged_server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": 3}, headers=key)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "n" and "3 completions" in error["message"] and "limit of 2" in error["message"]
    r = logged_server.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 1}, headers=key)
    assert r.status_code == 400
    r = logged_server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": 2}, headers=key)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_requests_arriving_together_respect_the_waiting_limit(logged_server: LiveServer) -> None:
    """Six submits in one event-loop turn against a limit of 2: before, each passed the check
    because none was counted until its prompt was tokenized (an await)."""
    engine = logged_server.async_engine
    serving = OpenAIServing(engine, logged_server.config)

    async def burst() -> list[object]:
        results = await asyncio.gather(*(serving.submit([(f"burst-{i}", "hi", SamplingParams(max_tokens=1))], True,
                                                        "prompt", ["prompt"]) for i in range(6)),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, RequestStream):
                async for _ in r:
                    pass
        return results

    results = asyncio.run_coroutine_threadsafe(burst(), engine._loop).result(timeout=60)
    assert [type(r).__name__ for r in results] == ["RequestStream"] * 2 + ["APIError"] * 4
    assert all(r.status == 503 for r in results[2:])
    logged_server.wait_idle()


def test_request_log_has_one_line_per_request(logged_server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    key = {"Authorization": b"Bearer " + UNICODE_KEY.encode("utf-8")}
    caplog.set_level(logging.INFO, logger="moestream.server.requests")
    r = logged_server.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "n": 2, "ignore_eos": True},
                           headers=key)
    assert r.status_code == 200
    body = r.json()
    logged_server.get("/health")
    deadline = time.monotonic() + 10
    while len([x for x in caplog.records if x.name == "moestream.server.requests"]) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    lines = [x.getMessage() for x in caplog.records if x.name == "moestream.server.requests"]
    completion = next(line for line in lines if line.startswith("POST /v1/completions 200"))
    assert f"request_id={body['id']}" in completion
    assert f"prompt_tokens={body['usage']['prompt_tokens']} output_tokens=6" in completion
    assert "latency=" in completion
    assert any(line.startswith("GET /health 200 request_id=- latency=") for line in lines)


# ---- 9. a reader that falls behind holds one output per request; all freed on close -------------


def _output(rid: str, n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, "p", [1], [CompletionOutput(0, "x" * n, list(range(n)), None, None,
                                                          "length" if finished else None)], finished, None)


def test_request_stream_keeps_only_the_newest_output_per_request() -> None:
    async def run() -> list[tuple[str, int]]:
        stream = RequestStream(["a", "b"])
        for n in range(1, 1001):
            stream._put(_output("a", n))
            stream._put(_output("b", n))
        assert stream.num_pending == 2  # not 2000
        stream._put(_output("a", 1001, finished=True))
        stream._put(_output("b", 1001, finished=True))
        return [(o.request_id, len(o.outputs[0].token_ids)) async for o in stream]

    assert asyncio.run(run()) == [("a", 1001), ("b", 1001)]


def test_a_closed_stream_is_freed(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    live_server.wait_idle()
    engine = live_server.async_engine
    add = engine.add
    refs: list[weakref.ref] = []

    async def spy(*args: object, **kw: object) -> RequestStream:
        stream = await add(*args, **kw)
        refs.append(weakref.ref(stream))
        return stream

    monkeypatch.setattr(engine, "add", spy)
    url = live_server.base_url + "/v1/completions"
    body = {"model": SERVED_MODEL, "prompt": "abc", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url, json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    monkeypatch.undo()
    live_server.wait_idle()
    (ref,) = refs
    deadline = time.monotonic() + 10
    while ref() is not None:
        gc.collect()
        assert time.monotonic() < deadline, "the closed stream is still referenced"
        time.sleep(0.01)


# ---- if the engine thread dies of its own bug: streams get an error, /health fails, stop works ---


def test_engine_thread_death_fails_streams_and_health(qwen3_moe_dir: str) -> None:
    server = LiveServer(EngineConfig(model=qwen3_moe_dir, dtype="float32", max_model_len=SERVER_MAX_MODEL_LEN),
                        ServerConfig(served_model_names=("m",)))
    try:
        url = server.base_url + "/v1/completions"
        body = {"prompt": "abc", "max_tokens": 100, "ignore_eos": True, "stream": True}
        engine = server.engine
        check = engine.has_unfinished_requests

        def buggy() -> bool:  # the engine loop's own check raises once a request has output
            if any(r.num_output_tokens >= 2 for r in engine.requests.values()):
                raise RuntimeError("a bug outside any guard")
            return check()

        engine.has_unfinished_requests = buggy
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            rest = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert '"type": "server_error"' in rest[-2] and "the engine thread failed" in rest[-2]
        assert not server.async_engine.is_running
        assert server.get("/health").status_code == 503
        r = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 500 and "not running" in r.json()["error"]["message"]
    finally:
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 10 and not server._thread.is_alive()
