"""max_tokens beyond what max_model_len leaves after the prompt: the server answers 400 in
vLLM's wording (naming the numbers) and loses no other request's work; the offline `LLM`
cuts the output at max_model_len (finish_reason "length") and warns once per instance;
an unset max_tokens runs to max_model_len on both, without error or warning."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from conftest import API_KEY, SERVED_MODEL, SERVER_MAX_MODEL_LEN
from live_server import LiveServer

from moestream import LLM, SamplingParams
from moestream.engine.input_processor import InputProcessor

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LOGGER = "moestream.engine.input_processor"
OFFLINE_MAX_MODEL_LEN = 32


def too_large(max_tokens: int, max_model_len: int, prompt_tokens: int) -> str:
    """vLLM's message (vllm serve's 400 for prompt + max_tokens over max_model_len)."""
    return (f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_tokens}).")


def test_check_max_tokens(offline_llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    tok = offline_llm.get_tokenizer()
    first, second = (InputProcessor(tok, 151936, 50) for _ in range(2))
    assert first.check_max_tokens(40, 10, strict=True) == 10  # exactly fits
    assert first.check_max_tokens(40, None, strict=True) == 10  # unset: up to max_model_len
    with pytest.raises(ValueError) as e:
        first.check_max_tokens(40, 11, strict=True)
    assert str(e.value) == too_large(11, 50, 40) + " Ask for at most 10 output tokens or shorten the prompt."
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert first.check_max_tokens(40, 11, strict=False) == 10
        assert first.check_max_tokens(45, 100, strict=False) == 5
        assert second.check_max_tokens(49, 2, strict=False) == 1  # each processor (engine) warns once
    assert [r.getMessage() for r in caplog.records] == [
        "max_tokens=11 is more than max_model_len=50 leaves after a prompt of 40 tokens: the output is cut at 10 "
        "tokens (finish_reason 'length'). Requests like it are cut the same way without another warning; raise "
        "max_model_len or lower max_tokens",
        "max_tokens=2 is more than max_model_len=50 leaves after a prompt of 49 tokens: the output is cut at 1 tokens "
        "(finish_reason 'length'). Requests like it are cut the same way without another warning; raise "
        "max_model_len or lower max_tokens",
    ]


def test_offline_output_is_cut_at_max_model_len_with_one_warning(qwen3_moe_dir: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    llm = LLM(qwen3_moe_dir, dtype="float32", max_model_len=OFFLINE_MAX_MODEL_LEN)
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (20, 25, 30)]
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outs = llm.generate(prompts[:2], params) + llm.generate(prompts[2:], params)
        unset = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 7, 2]  # max_model_len - prompt length
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
    records = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and "max_tokens=50 is more than max_model_len=32 leaves after a prompt of 20" in records[0]
    assert len(unset.outputs[0].token_ids) == 12 and unset.outputs[0].finish_reason == "length"
    assert unset.outputs[0].token_ids == outs[0].outputs[0].token_ids  # the cut changes nothing before it


def test_server_refuses_max_tokens_beyond_max_model_len(live_server: LiveServer, offline_llm: LLM) -> None:
    url = live_server.base_url
    ids = list(range(100, 200))  # 100 prompt tokens, 28 left under max_model_len 128
    room = SERVER_MAX_MODEL_LEN - len(ids)
    messages = [{"role": "user", "content": "count " * 40}]
    long = {"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 60, "ignore_eos": True, "temperature": 0,
            "stream": True}

    async def run() -> tuple[str, list[httpx.Response], int]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as http:
            async with http.stream("POST", url + "/v1/completions", json=long) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                text = ""
                while not (line := await lines.__anext__()).startswith("data: "):
                    pass
                text += json.loads(line[6:])["choices"][0]["text"]
                # While it runs: refused requests, then the boundary ones.
                chat_ok = await http.post(url + "/v1/chat/completions", json={
                    "model": SERVED_MODEL, "messages": messages, "max_tokens": 1})
                n = chat_ok.json()["usage"]["prompt_tokens"]
                answers = [
                    await http.post(url + "/v1/completions", json={"model": SERVED_MODEL, "prompt": ids,
                                                                   "max_tokens": room + 1}),
                    await http.post(url + "/v1/completions", json={"model": SERVED_MODEL, "prompt": [ids[:10], ids],
                                                                   "max_tokens": room + 5}),
                    await http.post(url + "/v1/chat/completions", json={"model": SERVED_MODEL, "messages": messages,
                                                                        "max_tokens": SERVER_MAX_MODEL_LEN - n + 1}),
                    await http.post(url + "/v1/chat/completions", json={
                        "model": SERVED_MODEL, "messages": messages, "max_completion_tokens": 1000, "stream": True}),
                    await http.post(url + "/v1/completions", json={"model": SERVED_MODEL, "prompt": ids,
                                                                   "max_tokens": room, "ignore_eos": True}),
                    await http.post(url + "/v1/chat/completions", json={"model": SERVED_MODEL, "messages": messages,
                                                                        "ignore_eos": True}),  # unset: no error
                ]
                async for line in lines:
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text, answers, n

    text, answers, n = asyncio.run(run())
    expected = [(room + 1, len(ids)), (room + 5, len(ids)), (SERVER_MAX_MODEL_LEN - n + 1, n), (1000, n)]
    for r, (asked, prompt_tokens) in zip(answers[:4], expected):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"].startswith(too_large(asked, SERVER_MAX_MODEL_LEN, prompt_tokens)), error["message"]
        assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
    fits, unset = (r.json() for r in answers[4:])
    assert fits["usage"]["completion_tokens"] == room and fits["choices"][0]["finish_reason"] == "length"
    assert unset["usage"]["completion_tokens"] == SERVER_MAX_MODEL_LEN - n
    assert unset["choices"][0]["finish_reason"] == "length"
    # The request that ran meanwhile lost nothing: the offline greedy result, whole.
    ref = offline_llm.generate("Hello", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0].outputs[0]
    assert text == ref.text and len(ref.token_ids) == 60
    live_server.wait_idle()
    assert live_server.get("/health").status_code == 200
