"""The live server under bad input, overload and shutdown: every error has its status and
OpenAI's error shape, never a 500; 200 malformed bodies (hypothesis) leave it healthy;
too many waiting requests get 503; SIGTERM lets an in-flight request finish, then exit 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from ports import free_port
from conftest import API_KEY, SERVED_MODEL, SERVER_MAX_MODEL_LEN
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import LiveServer

from moestream import LLM, SamplingParams
from moestream.config import EngineConfig
from moestream.server.serving import ServerConfig

AUTH = {"Authorization": f"Bearer {API_KEY}"}
OK = {"model": SERVED_MODEL, "prompt": "hi", "max_tokens": 1}
CHAT = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    """The response has `status` and OpenAI's error body; returns its "error" object."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["type"], str) and body["error"]["type"]
    return body["error"]


BAD_REQUESTS = [
    # (path, body, status, param, code, a piece of the message)
    ("/v1/completions", {**OK, "temperature": -1}, 400, "temperature", None, "greater than or equal to 0"),
    ("/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature", None, "valid number"),
    ("/v1/completions", {**OK, "top_p": 0}, 400, "top_p", None, "greater than 0"),
    ("/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens", None, "at least 1, got 0 (0 is allowed only with echo"),
    ("/v1/completions", {**OK, "max_tokens": -1}, 400, "max_tokens", None, "greater than or equal to 0"),
    ("/v1/completions", {**OK, "n": 0}, 400, "n", None, "greater than or equal to 1"),
    ("/v1/completions", {**OK, "logprobs": 21}, 400, "logprobs", None, "less than or equal to 20"),
    ("/v1/completions", {**OK, "stop": [""]}, 400, "stop", None, "must not be empty"),
    ("/v1/completions", {**OK, "stream": "yes"}, 400, "stream", None, "valid boolean"),
    ("/v1/completions", {**OK, "top_k": -2}, 400, "top_k", None, "greater than or equal to -1"),
    ("/v1/completions", {**OK, "min_p": 1.5}, 400, "min_p", None, "less than or equal to 1"),
    ("/v1/completions", {**OK, "repetition_penalty": 0}, 400, "repetition_penalty", None, "greater than 0"),
    ("/v1/completions", {**OK, "logit_bias": {"five": 1.0}}, 400, "logit_bias", None,
     "logit_bias keys must be token ids written as integers, got 'five'"),
    ("/v1/completions", {**OK, "logit_bias": {"5": "high"}}, 400, "logit_bias.5", None, "valid number"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {str(10**9): 1.0}}, 400, "logit_bias", None,
     "logit_bias token ids must be in [0, 151936); got [1000000000]"),
    ("/v1/completions", {**OK, "echo": True, "logprobs": 1, "prompt": "hello " * 300}, 400, "prompt", None,
     "The decoder prompt (301 tokens) is longer than the maximum model length of 128"),
    ("/v1/completions", {**OK, "prompt_logprobs": 21}, 400, "prompt_logprobs", None,
     "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
    ("/v1/completions", {**OK, "prompt_logprobs": -1}, 400, "prompt_logprobs", None, "greater than or equal to 0"),
    ("/v1/completions", {**OK, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", None,
     "`prompt_logprobs` are not available when `stream=True`."),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 0, "stream": True}, 400, "prompt_logprobs", None,
     "`prompt_logprobs` are not available when `stream=True`."),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 30}, 400, "prompt_logprobs", None,
     "Requested prompt logprobs of 30, which is greater than max allowed: 20"),
    ("/v1/completions", {**OK, "structured_outputs": {"regex": "[a-"}}, 400, "structured_outputs", None,
     "structured_outputs.regex does not compile"),
    ("/v1/completions", {**OK, "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs",
     None, "exactly one of json, regex, choice, grammar, json_object, structural_tag; got regex, choice"),
    ("/v1/completions", {**OK, "structured_outputs": {"structural_tags": "{}"}}, 400,
     "structured_outputs.structural_tags", None, "Extra inputs are not permitted"),
    ("/v1/completions", {**OK, "structured_outputs": {"structural_tag": {"structures": [], "triggers": ["<f"]}}},
     400, "structured_outputs", None, "structural_tag.structures must be a non-empty list"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "structural_tag", "triggers": ["<f="],
     "structures": [{"begin": "<g>", "schema": {}, "end": ""}]}}, 400, "structured_outputs", None,
     "starts with none of the triggers"),
    ("/v1/completions", {**OK, "structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": "[ "}}, 400,
     "structured_outputs", None, "structured_outputs.json does not compile"),
    ("/v1/completions", {**OK, "guided_regex": "a", "response_format": {"type": "json_object"}}, 400, "guided_regex",
     None, "give one constraint; got response_format, guided_regex"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema", None, "needs json_schema.schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type", None,
     "'json_schema' or 'structural_tag'"),
    ("/detokenize", {"tokens": [5, 10**9]}, 400, "tokens", None, "tokens[1] = 1000000000 is not a token id"),
    ("/detokenize", {"tokens": "5"}, 400, "tokens", None, "valid list"),
    ("/tokenize", {"prompt": "hi", "model": "nope"}, 404, "model", "model_not_found", "does not exist"),
    ("/tokenize", {}, 400, "prompt", None, "Field required"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     400, "messages[0].content[0]", None, "/tokenize takes text messages only"),
    ("/v1/completions", {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options", None, "stream: true"),
    ("/v1/completions", {"model": SERVED_MODEL}, 400, "prompt", None, "Field required"),
    ("/v1/completions", {**OK, "prompt": 5}, 400, "prompt", None, "valid"),
    ("/v1/completions", {**OK, "prompt": ""}, 400, "prompt", None, "must not be empty"),
    ("/v1/completions", {**OK, "prompt": "hello " * 300}, 400, "prompt", None, "max_model_len"),
    ("/v1/completions", {**OK, "prompt": [10**9]}, 400, "prompt", None, "prompt token ids must be ints"),
    ("/v1/completions", {**OK, "stop_token_ids": [10**9]}, 400, "stop_token_ids", None, "stop_token_ids must be"),
    ("/v1/completions", {**OK, "model": "gpt-9"}, 404, "model", "model_not_found", "'gpt-9' does not exist"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", None, "at least 1 item"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None,
     "'system', 'developer', 'user', 'assistant' or 'tool'"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].image_url", None, "messages[0].content[0].image_url: Field required"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image_url", "image_url": "data:..."}]}]}, 400,
     "messages[0].content[1].image_url", None, "valid dictionary"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400,
     "messages[0].content[0]", None, "unsupported content part type 'input_audio'; use 'text', 'image_url'"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", None, "needs logprobs: true"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", None, "greater than"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function", None, "required"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     None, "requires --enable-auto-tool-choice and --tool-call-parser"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi " * 300}]}, 400, "messages", None,
     "max_model_len"),
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model", "model_not_found", "does not exist"),
]


@pytest.mark.parametrize("path, body, status, param, code, fragment", BAD_REQUESTS,
                         ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_request_has_status_and_openai_error(live_server: LiveServer, path: str, body: dict, status: int, param: str,
                                                 code: str | None, fragment: str) -> None:
    error = assert_openai_error(live_server.post(path, json=body, headers=AUTH), status)
    assert error["param"] == param and error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"]


def test_malformed_bodies_routes_and_sizes(live_server: LiveServer) -> None:
    deep = b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"  # nested past Python's recursion limit
    for raw in (b"{not json", b"[1, 2]", b"", b'"prompt"', b"\xff\xfe", deep, b"[" * 100_000 + b"]" * 100_000):
        if len(raw) > live_server.config.max_request_body_bytes:
            error = assert_openai_error(live_server.post("/v1/completions", content=raw, headers=AUTH), 413)
            assert error["code"] == "request_too_large"
            continue
        error = assert_openai_error(live_server.post("/v1/completions", content=raw, headers=AUTH), 400)
        assert error["type"] == "invalid_request_error"
    big = {**OK, "prompt": "x" * (64 << 10)}
    error = assert_openai_error(live_server.post("/v1/completions", json=big, headers=AUTH), 413)
    assert error["code"] == "request_too_large" and str(64 << 10) in error["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
        for _ in range(80):
            yield b"x" * 1024

    error = assert_openai_error(live_server.post("/v1/completions", content=chunks(), headers=AUTH), 413)
    assert error["code"] == "request_too_large"
    assert assert_openai_error(live_server.get("/v1/nothing", headers=AUTH), 404)["code"] == "not_found"
    assert assert_openai_error(live_server.get("/v1/completions", headers=AUTH), 405)["code"] == "method_not_allowed"
    # The openai client surfaces the message and status.
    c = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=SERVED_MODEL, prompt="hi", top_p=2)
    assert e.value.status_code == 400 and "top_p" in e.value.message
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


_leaf = st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats(allow_nan=False) | st.text(max_size=8)
_json = st.recursive(_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                     max_leaves=8)
_finite = dict(allow_nan=False, allow_infinity=False)
INVALID = {  # field -> values that field must reject
    "temperature": st.floats(max_value=-1e-6, **_finite) | st.text(max_size=4) | st.lists(_leaf, max_size=2),
    "top_p": st.floats(min_value=1.0001, **_finite) | st.just(0.0) | st.text(max_size=4),
    "max_tokens": st.integers(max_value=0) | st.text(max_size=4) | st.floats(**_finite),
    "n": st.integers(max_value=0) | st.integers(min_value=129) | st.booleans(),
    "prompt": st.integers() | st.just("") | st.just([]) | st.lists(st.booleans(), min_size=1) | st.dictionaries(
        st.text(max_size=4), _leaf, max_size=2),
    "stop": st.integers() | st.lists(st.integers(), min_size=1) | st.just([""]),
    "logprobs": st.integers(min_value=21) | st.integers(max_value=-1) | st.text(max_size=3),
    "stream": st.text(max_size=4) | st.integers(),
    "seed": st.text(max_size=4) | st.floats(**_finite) | st.integers(min_value=2**63),
    "top_k": st.integers(max_value=-2) | st.text(max_size=3),
    "min_p": st.floats(min_value=1.0001, **_finite) | st.floats(max_value=-1e-6, **_finite),
    "repetition_penalty": st.floats(max_value=0.0, **_finite),
    "messages": st.just([]) | st.lists(st.fixed_dictionaries({"role": st.text(max_size=5), "content": _leaf}),
                                       min_size=1, max_size=2) | st.text(max_size=5),
    "model": st.text(max_size=8).filter(lambda s: s not in (SERVED_MODEL, "alias")),
}


@st.composite
def malformed(draw: st.DrawFn) -> tuple[str, bytes]:
    """(path, body): raw bytes, JSON that is not an object, or a request with one bad field."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    kind = draw(st.sampled_from(["bytes", "json", "field", "field"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "json":
        return path, json.dumps(draw(_json.filter(lambda v: not isinstance(v, dict)))).encode()
    base = dict(OK if path == "/v1/completions" else CHAT)
    fields = [f for f in INVALID if f != ("messages" if path == "/v1/completions" else "prompt")]
    field = draw(st.sampled_from(fields))
    extras = draw(st.dictionaries(st.text(max_size=6), _leaf, max_size=3))
    return path, json.dumps({**extras, **base, field: draw(INVALID[field])}).encode()


def test_200_malformed_bodies_leave_the_server_healthy(live_server: LiveServer) -> None:
    with httpx.Client(base_url=live_server.base_url, headers=AUTH, timeout=30) as http:

        @settings(max_examples=200, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(malformed())
        def check(case: tuple[str, bytes]) -> None:
            path, body = case
            r = http.post(path, content=body)
            assert r.status_code in (400, 404), (body, r.status_code, r.text)
            error = assert_openai_error(r, r.status_code)
            if r.status_code == 404:
                assert error["code"] == "model_not_found" and error["param"] == "model"

        check()
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={**OK, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    live_server.wait_idle()


@pytest.fixture(scope="module")
def small_server(qwen3_moe_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One sequence at a time, one waiting request at most, half the experts paged; the
    checkpoint's tokenizer without its chat template."""
    d = tmp_path_factory.mktemp("no_chat_template")
    for name in os.listdir(qwen3_moe_dir):
        if name != "chat_template.jinja":
            os.symlink(os.path.join(qwen3_moe_dir, name), d / name)
    server = LiveServer(EngineConfig(model=str(d), dtype="float32", max_model_len=SERVER_MAX_MODEL_LEN,
                                     max_num_seqs=1, expert_budget=0.5),
                        ServerConfig(served_model_names=("small",), max_waiting_requests=1))
    yield server
    server.stop()


def test_too_many_waiting_requests_get_503(small_server: LiveServer) -> None:
    url = small_server.base_url + "/v1/completions"
    body = {"model": "small", "prompt": "Hello", "temperature": 0}

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as http:
            long = {**body, "max_tokens": 120, "ignore_eos": True, "stream": True}
            async with http.stream("POST", url, json=long) as running:  # takes the only sequence slot
                assert running.status_code == 200
                lines = running.aiter_lines()
                while not (await lines.__anext__()).startswith("data: "):
                    pass
                waiting = asyncio.ensure_future(http.post(url, json={**body, "max_tokens": 2}))
                deadline = time.monotonic() + 30
                while small_server.async_engine.num_queued < 1:
                    assert time.monotonic() < deadline and not waiting.done()
                    await asyncio.sleep(0.005)
                refused = await http.post(url, json={**body, "max_tokens": 2})
            return refused, await waiting  # leaving the stream aborted the first request

    refused, waited = asyncio.run(run())
    error = assert_openai_error(refused, 503)
    assert error["code"] == "engine_overloaded" and error["type"] == "server_error"
    assert "limit is 1" in error["message"] and refused.headers["retry-after"] == "1"
    assert waited.status_code == 200 and waited.json()["usage"]["completion_tokens"] >= 1
    small_server.wait_idle()
    # n choices count as n waiting requests: more than the limit can never be admitted (400, not 503).
    error = assert_openai_error(small_server.post("/v1/completions", json={**body, "n": 2}), 400)
    assert error["param"] == "n" and "could never be admitted" in error["message"]


def test_chat_without_template_and_paged_expert_metrics(small_server: LiveServer) -> None:
    r = small_server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    error = assert_openai_error(r, 400)
    assert error["param"] == "messages" and "no chat template" in error["message"]
    r = small_server.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200
    small_server.wait_idle()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(small_server.get("/metrics").text) for s in f.samples}
    stats = small_server.engine.expert_stats()
    assert stats["misses"] > 0 and stats["bytes_read_per_tier"]["disk"] > 0
    assert samples[("moestream:expert_misses_total", ())] == stats["misses"]
    assert samples[("moestream:expert_hits_total", ())] == stats["hits"]
    assert samples[("moestream:expert_hit_rate", ())] == pytest.approx(stats["hit_rate"])
    assert samples[("moestream:expert_stall_seconds_total", ())] == pytest.approx(stats["stall_seconds"])
    assert samples[("moestream:expert_bytes_read_total", (("tier", "disk"),))] == stats["bytes_read_per_tier"]["disk"]


LONG_MODEL_LEN, LONG_TOKENS = 512, 448


def test_sigterm_finishes_the_in_flight_request_then_exits_0(qwen3_moe_dir: str, offline_llm: LLM,
                                                             tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moestream.server.cli", "serve", qwen3_moe_dir, "--port", str(port), "--dtype",
         "float32", "--max-model-len", str(LONG_MODEL_LEN), "--served-model-name", "m", "--chat-template",
         str(template)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        messages = [{"role": "user", "content": "Say something long."}]
        # long enough to be in flight when uvicorn's loop (a 0.1 s tick) sees the signal (regression:
        # 64 tokens could all be sent before it did, and nothing was left to wait for)
        body = {"model": "m", "messages": messages, "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        events = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            proc.send_signal(signal.SIGTERM)  # the request is in flight
            events += [line[6:] for line in lines if line.startswith("data: ")]
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert rc == 0, log
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == LONG_TOKENS
    prompt = "<user>Say something long.\n<assistant>"
    ids = offline_llm.get_tokenizer().encode(prompt, add_special_tokens=False)
    ref = offline_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    assert text.startswith(ref[0].outputs[0].text[:-4])  # its first 64 tokens' text (the last characters may merge)
    assert chunks[-1]["usage"]["prompt_tokens"] == len(ids)
    assert "Shutting down" in log and "Waiting for connections to close" in log
