"""The OpenAI-compatible server, live (real uvicorn on 127.0.0.1), driven by the official
`openai` client: results equal the offline engine's, under concurrency and disconnects;
metrics count what was sent."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from conftest import API_KEY, SERVED_MODEL
from live_server import LiveServer
from prometheus_client.parser import text_string_to_metric_families

from moestream import LLM, SamplingParams
from moestream.server.protocol import CompletionRequest

PROMPTS = ["Hello, my name is", "def add(a, b):", "The capital of France is", "import numpy as np\n"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def async_client(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat_prompt(llm: LLM, messages: list[dict]) -> dict:
    """The offline prompt of a chat: the tokenizer's template, tokenized without extra specials."""
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}


def metric_samples(server: LiveServer) -> dict[tuple[str, tuple], float]:
    """/metrics parsed with prometheus-client's parser: (sample name, sorted labels) -> value."""
    r = server.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_completions_match_offline(live_server: LiveServer, offline_llm: LLM) -> None:
    ref = offline_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    c = client(live_server)
    for prompt, r in zip(PROMPTS, ref):
        out = c.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert out.object == "text_completion" and out.model == SERVED_MODEL and out.id.startswith("cmpl-")
        assert out.choices[0].text == r.outputs[0].text
        assert out.choices[0].finish_reason == r.outputs[0].finish_reason
        assert out.usage.prompt_tokens == len(r.prompt_token_ids)
        assert out.usage.completion_tokens == len(r.outputs[0].token_ids)
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        chunks = list(c.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.outputs[0].text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.outputs[0].finish_reason
        assert len({ch.id for ch in chunks}) == 1
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(r.outputs[0].token_ids)
        assert all(ch.usage is None for ch in chunks[:-1])
    # A batch of prompts in one request, and a prompt of token ids; the alias name works too.
    out = c.completions.create(model="alias", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [ch.index for ch in out.choices] == list(range(len(PROMPTS)))
    assert [ch.text for ch in out.choices] == [r.outputs[0].text for r in ref]
    assert out.model == SERVED_MODEL
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    out = c.completions.create(model=SERVED_MODEL, prompt=ref[1].prompt_token_ids, max_tokens=12, temperature=0)
    assert out.choices[0].text == ref[1].outputs[0].text


def test_chat_matches_offline(live_server: LiveServer, offline_llm: LLM) -> None:
    r = offline_llm.generate(chat_prompt(offline_llm, MESSAGES), SamplingParams(temperature=0, max_tokens=10))[0]
    c = client(live_server)
    out = c.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == r.outputs[0].text
    assert out.choices[0].finish_reason == r.outputs[0].finish_reason
    assert out.usage.prompt_tokens == len(r.prompt_token_ids)
    assert out.usage.completion_tokens == len(r.outputs[0].token_ids)
    chunks = list(c.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.outputs[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.outputs[0].finish_reason
    assert chunks[-1].usage.prompt_tokens == len(r.prompt_token_ids)
    # Content given as a list of text parts renders the same prompt.
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    out = c.chat.completions.create(model=SERVED_MODEL, messages=parts, max_tokens=10, temperature=0)
    assert out.choices[0].message.content == r.outputs[0].text


def test_n_seed_and_vllm_extras_match_offline(live_server: LiveServer, offline_llm: LLM) -> None:
    kw = dict(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, repetition_penalty=1.2, max_tokens=10)
    c = client(live_server)
    out = c.completions.create(model=SERVED_MODEL, prompt=PROMPTS[0], n=3, seed=7, temperature=0.9, top_p=0.95,
                               max_tokens=10, extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.2})
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    # Choice i is seeded with seed + i.
    ref = [offline_llm.generate(PROMPTS[0], SamplingParams(seed=7 + i, **kw))[0].outputs[0].text for i in range(3)]
    assert [ch.text for ch in out.choices] == ref
    assert len(set(ref)) > 1
    assert out.usage.prompt_tokens == len(offline_llm.get_tokenizer().encode(PROMPTS[0]))
    # ignore_eos runs to max_tokens; n choices of a greedy chat are identical.
    out = c.completions.create(model=SERVED_MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                               extra_body={"ignore_eos": True})
    r = offline_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert out.choices[0].text == r.outputs[0].text and out.usage.completion_tokens == 20
    out = c.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, n=2, max_tokens=6, temperature=0)
    r = offline_llm.generate(chat_prompt(offline_llm, MESSAGES), SamplingParams(temperature=0, max_tokens=6))[0]
    assert [ch.message.content for ch in out.choices] == [r.outputs[0].text] * 2
    assert out.usage.completion_tokens == 2 * len(r.outputs[0].token_ids)


def test_stop_and_logprobs_match_offline(live_server: LiveServer, offline_llm: LLM) -> None:
    c = client(live_server)
    full = offline_llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip()
    ref = offline_llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop))[0]
    assert len(ref.outputs[0].text) < len(text) and ref.outputs[0].finish_reason == "stop"
    for stream in (False, True):
        out = c.completions.create(model=SERVED_MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=[stop],
                                   stream=stream, extra_body={"ignore_eos": True})
        chunks = list(out) if stream else [out]
        assert "".join(ch.choices[0].text for ch in chunks) == ref.outputs[0].text
        assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].stop_reason == stop

    ref = offline_llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0].outputs[0]
    out = c.completions.create(model=SERVED_MODEL, prompt=PROMPTS[3], max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ref.token_ids)
    for i, (t, entry) in enumerate(zip(ref.token_ids, ref.logprobs)):
        assert lp.tokens[i] == entry[t].decoded_token
        assert lp.token_logprobs[i] == pytest.approx(entry[t].logprob, abs=1e-4)
        assert 1 <= len(lp.top_logprobs[i]) <= 3
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)  # greedy: top-1
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(lp.tokens))]

    ref = offline_llm.generate(chat_prompt(offline_llm, MESSAGES),
                               SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0].outputs[0]
    for stream in (False, True):
        out = c.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                        logprobs=True, top_logprobs=2, stream=stream)
        content = [x for ch in out for x in (ch.choices[0].logprobs.content if ch.choices[0].logprobs else [])] \
            if stream else out.choices[0].logprobs.content
        assert [x.logprob for x in content] == pytest.approx([e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)],
                                                            abs=1e-4)
        assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob == pytest.approx(x.logprob, abs=1e-6)
                   for x in content)
        assert all(x.bytes == list(x.token.encode()) for x in content)


def test_models_health_version(live_server: LiveServer) -> None:
    models = client(live_server).models.list()
    assert [m.id for m in models.data] == [SERVED_MODEL, "alias"]
    assert live_server.get("/health").status_code == 200
    from moestream import __version__

    assert live_server.get("/version").json() == {"version": __version__}


def test_64_concurrent_streams_match_offline_and_free_every_block(live_server: LiveServer, offline_llm: LLM) -> None:
    prompts = [f"Request {i}: " + PROMPTS[i % len(PROMPTS)] * (1 + i % 3) for i in range(64)]
    ref = [o.outputs[0].text for o in offline_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
    live_server.wait_idle()
    free_at_start = live_server.engine.kv_cache.num_free_blocks
    running = []
    done = threading.Event()

    def watch() -> None:  # how many requests the engine batched together
        while not done.is_set():
            running.append(live_server.async_engine.snapshot.num_running)
            time.sleep(0.002)

    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await c.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                            stream=True)
        return "".join([ch.choices[0].text async for ch in stream])

    async def run() -> list[str]:
        async with async_client(live_server) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        got = asyncio.run(run())
    finally:
        done.set()
        watcher.join()
    assert got == ref
    assert max(running) > 1  # clients' requests ran in one batch
    live_server.wait_idle()
    assert live_server.engine.kv_cache.num_free_blocks == free_at_start == live_server.engine.kv_cache.num_blocks


def test_disconnected_clients_are_aborted_and_others_unchanged(live_server: LiveServer, offline_llm: LLM) -> None:
    prompts = [f"Client {i} says " + PROMPTS[i % len(PROMPTS)] for i in range(30)]
    leavers = {i for i in range(30) if i % 5 == 0}  # 20%
    ref = offline_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    live_server.wait_idle()
    before = metric_samples(live_server)

    async def one(c: openai.AsyncOpenAI, i: int) -> str | None:
        leaver = i in leavers
        stream = await c.completions.create(model=SERVED_MODEL, prompt=prompts[i], temperature=0, stream=True,
                                            max_tokens=100 if leaver else 8,
                                            extra_body={"ignore_eos": True} if leaver else None)
        if not leaver:
            return "".join([ch.choices[0].text async for ch in stream])
        n = 0
        async for _ in stream:
            n += 1
            if n == 2:
                break
        await stream.close()  # disconnect mid-stream
        return None

    async def run() -> list[str | None]:
        async with async_client(live_server) as c:
            return await asyncio.gather(*(one(c, i) for i in range(30)))

    got = asyncio.run(run())
    for i, text in enumerate(got):
        assert text == (None if i in leavers else ref[i].outputs[0].text)
    live_server.wait_idle()
    assert live_server.engine.kv_cache.num_free_blocks == live_server.engine.kv_cache.num_blocks
    after = metric_samples(live_server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("moestream:request_success_total", finished_reason="abort") == len(leavers)
    finished = sum(delta("moestream:request_success_total", finished_reason=r) for r in ("stop", "length"))
    assert finished == 30 - len(leavers)
    others = sum(len(ref[i].outputs[0].token_ids) for i in range(30) if i not in leavers)
    leaver_tokens = delta("moestream:generation_tokens_total") - others
    assert len(leavers) * 2 <= leaver_tokens < len(leavers) * 100


def test_metrics_count_what_was_sent(live_server: LiveServer, offline_llm: LLM) -> None:
    live_server.wait_idle()
    before = metric_samples(live_server)
    c = client(live_server)
    tok = offline_llm.get_tokenizer()
    c.completions.create(model=SERVED_MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                         extra_body={"ignore_eos": True})
    c.completions.create(model=SERVED_MODEL, prompt=PROMPTS[1], max_tokens=4, n=2, temperature=0,
                         extra_body={"ignore_eos": True})
    list(c.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=3, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True}))
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=SERVED_MODEL, prompt=PROMPTS[0], temperature=-1)
    live_server.wait_idle()
    after = metric_samples(live_server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    prompt_tokens = (len(tok.encode(PROMPTS[0])) + 2 * len(tok.encode(PROMPTS[1]))
                     + len(chat_prompt(offline_llm, MESSAGES)["prompt_token_ids"]))
    assert delta("moestream:request_success_total", finished_reason="length") == 4
    assert delta("moestream:request_success_total", finished_reason="stop") == 0
    assert delta("moestream:prompt_tokens_total") == prompt_tokens
    assert delta("moestream:generation_tokens_total") == 4 + 2 * 4 + 3
    assert delta("moestream:http_requests_total", path="/v1/completions", status="200") == 2
    assert delta("moestream:http_requests_total", path="/v1/completions", status="400") == 1
    assert delta("moestream:http_requests_total", path="/v1/chat/completions", status="200") == 1
    assert delta("moestream:time_to_first_token_seconds_count") == 4
    assert delta("moestream:e2e_request_latency_seconds_count") == 4
    assert delta("moestream:time_per_output_token_seconds_count") == 4
    assert delta("moestream:inter_token_latency_seconds_count") == 3 + 2 * 3 + 2
    assert after[("moestream:num_requests_running", ())] == 0
    assert after[("moestream:num_requests_waiting", ())] == 0
    assert after[("moestream:kv_cache_blocks_in_use", ())] == 0
    assert after[("moestream:kv_cache_blocks_total", ())] == live_server.engine.kv_cache.num_blocks
    assert after[("moestream:expert_hit_rate", ())] == 1.0  # all experts resident
    assert after[("moestream:expert_bytes_read_total", (("tier", "disk"),))] == 0


def test_api_key_is_required_on_v1_only(live_server: LiveServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = live_server.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": "hi"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and "API key" in r.json()["error"]["message"]
    r = live_server.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert live_server.get("/health").status_code == 200  # health and metrics need no key
    assert live_server.get("/metrics").status_code == 200


def test_cancelled_non_streaming_request_is_aborted(live_server: LiveServer) -> None:
    live_server.wait_idle()
    aborted = metric_samples(live_server).get(("moestream:request_success_total", (("finished_reason", "abort"),)), 0)
    body = {"model": SERVED_MODEL, "prompt": PROMPTS[0], "max_tokens": 120, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.base_url + "/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=httpx.Timeout(5, read=0.3))
    live_server.wait_idle()  # the client gave up: its request was aborted and its blocks freed
    assert live_server.engine.kv_cache.num_free_blocks == live_server.engine.kv_cache.num_blocks
    after = metric_samples(live_server)
    assert after[("moestream:request_success_total", (("finished_reason", "abort"),))] == aborted + 1


def test_logit_bias_matches_offline_and_is_clamped(live_server: LiveServer, offline_llm: LLM) -> None:
    c = client(live_server)
    expected = offline_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6,
                                                                logit_bias={220: 5.0, 13: -100.0}))[0].outputs[0]
    plain = offline_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert expected.token_ids != plain.token_ids  # the bias matters for this prompt
    out = c.completions.create(model=SERVED_MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                               logit_bias={"220": 5.0, "13": -100.0})
    assert out.choices[0].text == expected.text
    live_server.wait_idle()
    # OpenAI's range [-100, 100], as vLLM clamps it
    req = CompletionRequest(prompt="x", logit_bias={"5": 1000.0, " 6": -1e6, "7": 0.5})
    assert req.logit_bias_ids() == {5: 100.0, 6: -100.0, 7: 0.5}
