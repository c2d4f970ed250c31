"""Evaluation through the server: `echo` with logprobs on /v1/completions (the prompt's tokens
scored as HF float32 scores them, a second sighting included), `max_tokens` 0, streaming
and `n`; vLLM's `prompt_logprobs` extra; /tokenize and /detokenize round trips; and
lm-evaluation-harness's `local-completions` run unmodified against a live server of the
demo model (its log-likelihoods and accuracy equal HF's, its generations offline greedy's)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from conftest import API_KEY, SERVED_MODEL, parity_prompts
from live_server import LiveServer

from moestream import LLM, EngineConfig, SamplingParams
from moestream.demo import demo_model_path
from moestream.server.serving import ServerConfig

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ATOL = 1e-4
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hf_model(qwen3_moe_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen3_moe_dir, dtype=torch.float32).eval()


def teacher_forced(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """HF's log-probabilities [len(ids), V] float32 after each position."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


@pytest.fixture(scope="module")
def chunked_budget_server(qwen3_moe_dir: str) -> Iterator[LiveServer]:
    """The tiny Qwen3-MoE served with chunked prefill (16-token chunks, under the longest
    prompt's 40) and a 25% expert budget, prefix caching on."""
    server = LiveServer(EngineConfig(model=qwen3_moe_dir, dtype="float32", max_model_len=128,
                                     max_num_batched_tokens=16, expert_budget=0.25),
                        ServerConfig(served_model_names=(SERVED_MODEL,), api_key=API_KEY))
    yield server
    server.stop()


@pytest.mark.parametrize("server_name", ["live_server", "chunked_budget_server"])
def test_echo_logprobs_equal_hf(server_name: str, hf_model: torch.nn.Module, request: pytest.FixtureRequest) -> None:
    live_server: LiveServer = request.getfixturevalue(server_name)
    prompts = parity_prompts()
    tok = live_server.engine.tokenizer
    body = {"model": SERVED_MODEL, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0}
    answers = [live_server.post("/v1/completions", json=body, headers=AUTH).json() for _ in range(2)]
    for answer in answers:  # the second sighting finds the prompts cached and must not use them
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for choice, p in zip(answer["choices"], prompts):
            ref = teacher_forced(hf_model, p)  # [P, V]
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(p) + 1  # the prompt's tokens, then the generated one
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            ours = torch.tensor(lp["token_logprobs"][1:len(p)])
            assert torch.allclose(ours, ref[torch.arange(len(p) - 1), torch.tensor(p[1:], dtype=torch.long)], atol=ATOL)
            tops = torch.tensor([max(t.values()) for t in lp["top_logprobs"][1:]])
            assert torch.allclose(tops, ref.max(dim=-1).values, atol=ATOL)
            generated = int(ref[-1].argmax())
            assert abs(lp["token_logprobs"][-1] - ref[-1, generated].item()) < ATOL
            assert choice["text"] == tok.decode(p) + tok.decode([generated])
            assert lp["tokens"][: len(p)] == [tok.decode([t]) for t in p]
    live_server.wait_idle()
    if server_name == "chunked_budget_server":  # experts were really paged
        assert live_server.engine.expert_stats()["misses"] > 0


def test_echo_variants(live_server: LiveServer, offline_llm: LLM) -> None:
    prompt = "The quick brown fox"
    ids = live_server.engine.tokenizer.encode(prompt)
    base = {"model": SERVED_MODEL, "prompt": prompt, "echo": True, "temperature": 0}
    whole = live_server.post("/v1/completions", json={**base, "max_tokens": 5, "logprobs": 2}, headers=AUTH).json()
    offline = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].text
    choice = whole["choices"][0]
    assert choice["text"] == prompt + offline
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 5 and lp["text_offset"][0] == 0
    assert lp["text_offset"][len(ids)] == len(prompt)  # generated tokens' offsets count past the prompt
    # OpenAI: "up to logprobs + 1 elements": the chosen token's, then the top 2
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert 1 <= len(top) <= 3 and next(iter(top)) == token and top[token] == value

    # max_tokens 0: the prompt alone, and its scores; logprobs 0 still shows each chosen token
    # (regression: top_logprobs were all {}, and lm-eval's max() over them raised)
    zero = live_server.post("/v1/completions", json={**base, "max_tokens": 0, "logprobs": 0}, headers=AUTH).json()
    assert zero["choices"][0]["text"] == prompt and zero["choices"][0]["finish_reason"] == "length"
    assert zero["choices"][0]["logprobs"]["token_logprobs"][1:] == lp["token_logprobs"][1:len(ids)]
    zlp = zero["choices"][0]["logprobs"]
    assert all(top == {t: v} for t, v, top in zip(zlp["tokens"][1:], zlp["token_logprobs"][1:], zlp["top_logprobs"][1:]))

    # regression: a character split over byte tokens made the echo's offsets run past the text and back
    wide = live_server.post("/v1/completions", headers=AUTH, json={
        "model": SERVED_MODEL, "prompt": 'x="日本"', "echo": True, "logprobs": 0, "max_tokens": 3, "temperature": 0}).json()
    offsets, text = wide["choices"][0]["logprobs"]["text_offset"], wide["choices"][0]["text"]
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    assert zero["usage"]["completion_tokens"] == 0 and zero["usage"]["prompt_tokens"] == len(ids)

    # streamed: the echo comes with the first chunk; the pieces add up to the whole answer
    with httpx.stream("POST", live_server.base_url + "/v1/completions", headers=AUTH, timeout=60,
                      json={**base, "max_tokens": 5, "logprobs": 2, "stream": True}) as r:
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]] == lp["token_logprobs"]
    assert [x for c in chunks for x in c["choices"][0]["logprobs"]["text_offset"]] == lp["text_offset"]

    # n = 2 with a seed: every choice starts with the prompt; prompt_logprobs (vLLM's extra) once per choice
    two = live_server.post("/v1/completions", json={**base, "max_tokens": 3, "n": 2, "seed": 7, "temperature": 1.0,
                                                   "prompt_logprobs": 1}, headers=AUTH).json()
    for c in two["choices"]:
        assert c["text"].startswith(prompt) and len(c["prompt_logprobs"]) == len(ids)
        assert c["prompt_logprobs"][0] is None
        entry = c["prompt_logprobs"][1][str(ids[1])]
        assert abs(entry["logprob"] - lp["token_logprobs"][1]) < ATOL and entry["decoded_token"] == lp["tokens"][1]

    chat = live_server.post("/v1/chat/completions", headers=AUTH, json={
        "model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0,
    }).json()
    assert chat["prompt_logprobs"][0] is None and chat["usage"]["prompt_tokens"] == len(chat["prompt_logprobs"])
    live_server.wait_idle()


def test_tokenize_detokenize_round_trip(live_server: LiveServer) -> None:
    tok = live_server.engine.tokenizer
    text = "Hello, wörld! 你好 <|im_end|>\n  def f(x): return x"
    r = live_server.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"]) and r["max_model_len"] == 128
    assert live_server.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    r = live_server.post("/tokenize", json={"messages": messages, "model": SERVED_MODEL}).json()
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r["tokens"] == tok.encode(expected, add_special_tokens=False) and r["count"] == len(r["tokens"])
    assert live_server.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": expected}
    # the same count the chat endpoint charges for these messages
    chat = live_server.post("/v1/chat/completions", headers=AUTH,
                            json={"model": SERVED_MODEL, "messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == r["count"]
    assert live_server.get("/tokenizer_info").status_code == 404  # off unless --enable-tokenizer-info-endpoint
    # regression: a null `messages` next to a prompt was taken for a chat request (400)
    r = live_server.post("/tokenize", json={"prompt": "hi", "messages": None})
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode("hi")
    live_server.wait_idle()


# ---- lm-evaluation-harness, live -------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_server() -> Iterator[LiveServer]:
    """`moestream serve --model demo --dtype float32 --enable-tokenizer-info-endpoint`, live."""
    server = LiveServer(EngineConfig(model=demo_model_path(), dtype="float32", max_model_len=256),
                        ServerConfig(served_model_names=("demo",), enable_tokenizer_info_endpoint=True))
    yield server
    server.stop()


def encode_pair(tok: object, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `_encode_pair`: trailing spaces of the context move to the continuation;
    the continuation's ids are the whole's past the context's."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def test_lm_eval_local_completions_equals_hf(demo_server: LiveServer, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval", reason="lm-eval is part of the test extra: pip install -e '.[test]'")
    from transformers import AutoModelForCausalLM

    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
           f"base_url={demo_server.base_url}/v1/completions,model=demo", "--tasks", "stdlib_mc", "stdlib_gen",
           "--include_path", "bench/eval", "--output_path", str(tmp_path / "out"), "--log_samples"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Using remote tokenizer" in run.stderr  # it found /tokenizer_info and /tokenize

    def samples(task: str) -> list[dict]:
        (path,) = glob.glob(str(tmp_path / "out" / "*" / f"samples_{task}_*.jsonl"))
        return [json.loads(line) for line in Path(path).read_text().splitlines()]

    (results_path,) = glob.glob(str(tmp_path / "out" / "*" / "results_*.json"))
    results = json.loads(Path(results_path).read_text())["results"]

    tok = demo_server.engine.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    mc = samples("stdlib_mc")
    assert len(mc) == 10
    correct = 0
    for s in mc:
        ours = [float(r[0][0]) for r in s["resps"]]
        refs = []
        for choice in s["doc"]["choices"]:
            ctx, cont = encode_pair(tok, s["doc"]["question"], choice)
            lp = teacher_forced(hf, ctx + cont)
            refs.append(sum(lp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont)))
        assert ours == pytest.approx(refs, abs=ATOL), s["doc"]
        correct += max(range(len(refs)), key=refs.__getitem__) == s["doc"]["answer"]
    assert results["stdlib_mc"]["acc,none"] == pytest.approx(correct / len(mc))

    gen = samples("stdlib_gen")
    assert len(gen) == 5
    llm = LLM(demo_model_path(), dtype="float32", max_model_len=256)
    outs = llm.generate([{"prompt_token_ids": tok.encode(s["doc"]["prompt"], add_special_tokens=False)} for s in gen],
                        SamplingParams(**{**llm.llm_engine.default_sampling_fields,  # as the server: the
                                          "temperature": 0.0, "max_tokens": 16, "stop": ["\n"]}))  # model's defaults
    assert [s["resps"][0][0] for s in gen] == [o.outputs[0].text for o in outs]
    exact = sum(o.outputs[0].text == s["doc"]["target"] for o, s in zip(outs, gen)) / len(gen)
    assert results["stdlib_gen"]["exact_match,none"] == pytest.approx(exact)
    demo_server.wait_idle()
