"""Regression tests for bad input and failure isolation (found by adversarial testing):
bad input is a ValueError and changes nothing; a failing request never takes others down;
abandoned streams free their blocks."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from moestream import LLM, SamplingParams
from moestream.config import EngineConfig


@pytest.fixture(scope="module")
def llm(qwen3_moe_dir: str) -> LLM:
    return LLM(qwen3_moe_dir, dtype="float32", max_model_len=64)


GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature="1"), "temperature"),
        (dict(temperature=None), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=True), "top_k"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(logprobs=True), "logprobs"),
        (dict(stop=5), "stop"),
        (dict(stop_token_ids=[None]), "stop_token_ids"),
        (dict(logits_processors=5), "logits_processors"),
    ],
)
def test_sampling_params_type_errors_are_value_errors(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_model_len="64"), "max_model_len"),
        (dict(max_model_len=64.5), "max_model_len"),
        (dict(kv_cache_memory_bytes=1e9), "kv_cache_memory_bytes"),
        (dict(block_size=True), "block_size"),
        (dict(seed=None), "seed"),
        (dict(device="nonsense"), "device"),
    ],
)
def test_engine_config_type_errors_are_value_errors(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="/x", **kwargs)


def test_bad_prompts_and_engine_limits(llm: LLM) -> None:
    engine = llm.llm_engine
    for prompt in (None, 5, {"prompt_token_ids": None}, {"prompt_token_ids": 5}, [True, False], {"prompt": 3}):
        with pytest.raises(ValueError):
            llm.generate(prompt, GREEDY)
    with pytest.raises(ValueError, match="Requested sample logprobs of 21, which is greater than max allowed: 20"):
        llm.generate("hi", SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="Requested prompt logprobs of 21, which is greater than max allowed: 20"):
        llm.generate("hi", SamplingParams(prompt_logprobs=21))
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 151936\)"):
        llm.generate("hi", SamplingParams(stop_token_ids=[-1]))
    assert not engine.requests and not engine.has_unfinished_requests()
    assert llm.generate((5, 6, 7), GREEDY)[0].prompt_token_ids == [5, 6, 7]  # a tuple of ids is one prompt


def test_bad_params_in_a_list_queue_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="must be a SamplingParams"):
        llm.generate(["a", "b"], [GREEDY, "x"])
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate(["a", "b"], [GREEDY, SamplingParams(logprobs=100)])
    assert not llm.llm_engine.requests


def test_failing_logits_processor_aborts_only_its_request(llm: LLM) -> None:
    engine = llm.llm_engine
    free0 = engine.kv_cache.num_free_blocks
    ref = llm.generate(["healthy"], GREEDY)[0].outputs[0].token_ids

    def boom(ids: list[int], logits):
        if len(ids) == 2:
            raise RuntimeError("user bug")
        return logits

    def wrong_shape(ids: list[int], logits):
        return logits[:10]

    outs = llm.generate(
        ["healthy", "faulty", "also faulty"],
        [GREEDY, SamplingParams(temperature=0, max_tokens=6, logits_processors=[boom]),
         SamplingParams(temperature=0, max_tokens=6, logits_processors=[wrong_shape])],
    )
    assert outs[0].outputs[0].token_ids == ref and outs[0].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].finish_reason == "abort" and len(outs[1].outputs[0].token_ids) == 2
    assert outs[2].outputs[0].finish_reason == "abort" and outs[2].outputs[0].token_ids == []
    assert engine.kv_cache.num_free_blocks == free0
    assert llm.generate(["healthy"], GREEDY)[0].outputs[0].token_ids == ref  # the engine still works


def test_closed_stream_aborts_its_requests(llm: LLM) -> None:
    engine = llm.llm_engine
    free0 = engine.kv_cache.num_free_blocks
    stream = llm.generate_stream(["one", "two", "three"], SamplingParams(temperature=0, max_tokens=20))
    next(stream)
    assert engine.kv_cache.num_free_blocks < free0
    stream.close()
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == free0


def test_stream_yields_only_its_own_requests(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("someone else's", SamplingParams(temperature=0, max_tokens=30), request_id="other")
    seen = {out.request_id for out in llm.generate_stream(["mine"], SamplingParams(temperature=0, max_tokens=3))}
    assert len(seen) == 1 and "other" not in seen
    assert "other" in engine.requests
    engine.abort_request("other")


def test_auto_ids_skip_user_ids(llm: LLM) -> None:
    engine = llm.llm_engine
    n = int(engine.add_request("x", GREEDY))
    engine.add_request("y", GREEDY, request_id=str(n + 1))
    engine.add_request("z", GREEDY, request_id=str(n + 2))
    assert engine.add_request("w", GREEDY) == str(n + 3)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    assert not engine.has_unfinished_requests()


def test_stop_token_text_left_out(llm: LLM) -> None:
    ref = llm.generate(["text"], GREEDY)[0].outputs[0]
    tok = llm.get_tokenizer()
    stop_id = ref.token_ids[2]
    first = ref.token_ids.index(stop_id)
    out = llm.generate(["text"], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_id]))[0].outputs[0]
    prompt_ids = tok.encode("text")
    want = tok.decode(prompt_ids + ref.token_ids[:first])[len(tok.decode(prompt_ids)):]
    assert out.token_ids == ref.token_ids[: first + 1] and out.text == want
    out = llm.generate(
        ["text"], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    )[0].outputs[0]
    with_stop = tok.decode(prompt_ids + ref.token_ids[: first + 1])[len(tok.decode(prompt_ids)):]
    assert out.text == with_stop and out.text != want


def test_first_llm_in_a_fresh_process_is_freed_without_gc(qwen3_moe_dir: str) -> None:
    """The first LLM of a process used to stay alive: a lazy `import transformers` inside the
    constructor pinned its frames in an import-time reference cycle."""
    code = textwrap.dedent(f"""
        import gc, weakref
        gc.disable()
        from moestream import LLM, SamplingParams
        llm = LLM({qwen3_moe_dir!r}, dtype="float32", max_model_len=64)
        llm.generate(["first run"], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3))
        ref = weakref.ref(llm.llm_engine)
        kv = weakref.ref(llm.llm_engine.runner.kv_caches[0][0])
        del llm
        print("freed" if ref() is None and kv() is None else "alive")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "freed", out.stderr[-2000:]


def test_add_requests_is_all_or_none(llm: LLM) -> None:
    from moestream import SamplingParams

    engine = llm.llm_engine
    before = set(engine.requests)
    free = engine.kv_cache.num_free_blocks
    good = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match="prompt token ids must be ints"):
        engine.add_requests([("aon-1", "hello", good), ("aon-2", [10**9], good)])
    with pytest.raises(ValueError, match="unique within one call"):
        engine.add_requests([("aon-1", "hello", good), ("aon-1", "again", good)])
    assert set(engine.requests) == before and engine.kv_cache.num_free_blocks == free
    assert engine.add_requests([("aon-1", "hello", good), (None, [5, 6], good)])[0] == "aon-1"
    with pytest.raises(ValueError, match="'aon-1' is already in flight"):
        engine.add_requests([("aon-3", "x", good), ("aon-1", "y", good)])
    assert "aon-3" not in engine.requests
    while engine.has_unfinished_requests():
        engine.step()
