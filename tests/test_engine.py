"""Engine behaviour through the offline API: bad input, seeds, stops, streaming, abort."""

from __future__ import annotations

import pytest

from moestream import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(qwen3_moe_dir: str) -> LLM:
    return LLM(qwen3_moe_dir, dtype="float32", max_model_len=64)


def test_bad_input_raises_and_keeps_requests_in_flight(llm: LLM) -> None:
    engine = llm.llm_engine
    free_at_start = engine.kv_cache.num_free_blocks
    engine.add_request("Hello there", SamplingParams(temperature=0, max_tokens=6), request_id="ok1")
    engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=6), request_id="ok2")
    engine.step()
    cases = [
        (lambda: engine.add_request("", SamplingParams()), "prompt is empty"),
        (lambda: engine.add_request({"prompt_token_ids": []}, SamplingParams()), "prompt is empty"),
        (lambda: engine.add_request({"prompt_token_ids": [1] * 64}, SamplingParams()), "max_model_len is 64"),
        (lambda: engine.add_request({"prompt_token_ids": [10**9]}, SamplingParams()), r"token ids must be ints in \[0, 151936\)"),
        (lambda: engine.add_request("hi", SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda: engine.add_request("hi", SamplingParams(top_p=0.0)), "top_p"),
        (lambda: engine.add_request("hi", SamplingParams(top_p=1.5)), "top_p"),
        (lambda: engine.add_request("hi", SamplingParams(), request_id="ok1"), "already in flight"),
        (lambda: engine.add_request(3.5, SamplingParams()), "a prompt must be"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))  # validated before anything is queued
    assert set(engine.requests) == {"ok1", "ok2"}
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"ok1", "ok2"}
    assert all(len(o.outputs[0].token_ids) == 6 and o.outputs[0].finish_reason == "length" for o in done.values())
    assert engine.kv_cache.num_free_blocks == free_at_start


def test_missing_model_dir() -> None:
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model/dir")


def test_generate_matches_request_order_and_params_list(llm: LLM) -> None:
    outs = llm.generate(["a", "bb", "ccc"], [SamplingParams(temperature=0, max_tokens=n) for n in (1, 2, 3)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]
    assert [o.prompt for o in outs] == ["a", "bb", "ccc"]
    m = outs[2].metrics
    assert m.num_prompt_tokens == len(outs[2].prompt_token_ids) and m.num_generation_tokens == 3
    assert m.ttft is not None and m.ttft > 0 and m.tpot is not None and m.tpot > 0
    with pytest.raises(ValueError, match="3 prompts but 2 sampling params"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])


def test_seed_reproducible_whatever_the_batch(llm: LLM) -> None:
    sp = SamplingParams(temperature=1.0, seed=42, max_tokens=12)
    alone = llm.generate(["The seed test"], sp)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n) for n in (3, 20)]
    batched = llm.generate(["noise one", "The seed test", "noise two two"], [others[0], sp, others[1]])
    assert batched[1].outputs[0].token_ids == alone
    different = llm.generate(["The seed test"], SamplingParams(temperature=1.0, seed=43, max_tokens=12))
    assert different[0].outputs[0].token_ids != alone


def test_stop_token_ids_and_stop_strings(llm: LLM) -> None:
    greedy = llm.generate(["Stop me"], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    tokens, text = greedy.token_ids, greedy.text
    out = llm.generate(["Stop me"], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[tokens[3]]))[0].outputs[0]
    cut = tokens.index(tokens[3])
    assert out.token_ids == tokens[: cut + 1] and out.finish_reason == "stop" and out.stop_reason == tokens[3]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the greedy text should have visible characters to stop on"
    out = llm.generate(["Stop me"], SamplingParams(temperature=0, max_tokens=10, stop=[stop]))[0].outputs[0]
    assert out.text == text[: text.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate(
        ["Stop me"], SamplingParams(temperature=0, max_tokens=10, stop=[stop], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert out.text == text[: text.index(stop) + len(stop)]


def test_eos_and_ignore_eos(llm: LLM) -> None:
    eos = llm.get_tokenizer().eos_token_id

    def force_eos(ids: list[int], logits):
        if len(ids) == 2:
            logits[eos] = 1e9
        return logits

    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=8, logits_processors=[force_eos]))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    out = llm.generate(
        ["x"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logits_processors=[force_eos])
    )[0].outputs[0]
    assert len(out.token_ids) == 8 and out.token_ids[2] == eos and out.finish_reason == "length"


def test_max_model_len_stops_generation(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": list(range(100, 160))}, SamplingParams(temperature=0, max_tokens=None))
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].finish_reason == "length"


def test_logprobs(llm: LLM) -> None:
    out = llm.generate(["log probs"], SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == 3
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the top token
        assert 2 <= len(lp) <= 3
        assert all(v.logprob <= 0 for v in lp.values())
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)))


def test_stream_is_cumulative_and_ends_as_generate(llm: LLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=8)
    final = llm.generate(["stream me", "and me"], sp)
    seen: dict[str, list] = {}
    for out in llm.generate_stream(["stream me", "and me"], sp):
        seen.setdefault(out.request_id, []).append(out)
    assert len(seen) == 2
    for outs, ref in zip(seen.values(), final):
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 9))
        assert [o.finished for o in outs] == [False] * 7 + [True]
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert outs[-1].outputs[0].text == ref.outputs[0].text
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_abort_frees_blocks_and_spares_others(llm: LLM) -> None:
    engine = llm.llm_engine
    free0 = engine.kv_cache.num_free_blocks
    sp = SamplingParams(temperature=0, max_tokens=10)
    ref = llm.generate(["keep me"], sp)[0].outputs[0].token_ids
    engine.add_request("keep me", sp, request_id="keep")
    engine.add_request({"prompt_token_ids": list(range(200, 240))}, sp, request_id="drop")
    engine.step()
    engine.step()
    assert engine.kv_cache.block_table("drop")
    aborted = engine.abort_request("drop")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert engine.kv_cache.block_table("drop") == []
    assert engine.abort_request("drop") is None
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.request_id == "keep" and final.outputs[0].token_ids == ref
    assert engine.kv_cache.num_free_blocks == free0
