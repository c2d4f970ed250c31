"""Prefix caching of attention models (Qwen3-MoE, Mixtral) and hybrid ones (Qwen3-Next,
Qwen3.5-MoE, through linear-attention state checkpoints): second sightings hit exactly the
expected blocks, and their output is token-exact with HF float32 and with the miss; chat
turns hit the previous turn; expert paging and preemption keep working; a hypothesis
property test drives the block pool through random admissions, computes and frees. The
hybrid-only cases (checkpoint tiers, bf16, intervals) are in test_prefix_caching_hybrid.py."""

from __future__ import annotations

import random

import pytest
from conftest import NUM_NEW_TOKENS, HFReference
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import LogitsRecorder, check_all, greedy_params

from moestream import LLM, SamplingParams
from moestream.engine.kv_cache import KVCacheManager

BS = 16
NEW = NUM_NEW_TOKENS  # what the cached HF reference generates


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_moe"])
def arch_dir(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(scope="module")
def arch_reference(arch_dir: str) -> HFReference:
    return HFReference(arch_dir)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 30000) for _ in range(n)]


def _generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[tuple[list[int], LogitsRecorder]], list[int]]:
    recs = [LogitsRecorder() for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy_params(r, NEW) for r in recs])
    return [(o.outputs[0].token_ids, r) for o, r in zip(outs, recs)], [o.num_cached_tokens for o in outs]


def test_second_sighting_hits_and_matches_hf(arch_dir: str, arch_reference: HFReference) -> None:
    rng = random.Random(7)
    prefix = _tokens(rng, 3 * BS)
    prompts = [prefix + _tokens(rng, 5), prefix + _tokens(rng, 100), _tokens(rng, BS + 1), _tokens(rng, 10)]
    llm = LLM(arch_dir, dtype="float32", max_model_len=512, block_size=BS)
    first, cached = _generate(llm, prompts)
    assert cached == [0, 0, 0, 0]  # all admitted in one step: nothing was cached yet
    second, cached = _generate(llm, prompts)
    # Full blocks of (prompt + output - 1) computed tokens were cached; a hit stops before the
    # last prompt token: 53 -> 3 blocks, 148 -> 9, 17 (1 block + 1 token) -> 1, 10 -> 0.
    assert cached == [48, 144, 16, 0]
    assert [t for t, _ in second] == [t for t, _ in first]
    check_all(prompts, second, arch_reference, "second sighting")
    stats = llm.prefix_cache_stats()
    assert stats["enabled"] and stats["hits"] == 48 + 144 + 16
    assert stats["queries"] == 2 * sum(len(p) for p in prompts)


def test_shared_prefix_with_long_suffixes_and_mixed_batch(arch_dir: str, arch_reference: HFReference) -> None:
    """The SGLang #22935 shape: a 3-block prefix, then suffixes of 5, 100 and 400 tokens,
    run together with prompts that miss."""
    rng = random.Random(8)
    prefix = _tokens(rng, 3 * BS)
    llm = LLM(arch_dir, dtype="float32", max_model_len=512, block_size=BS)
    _generate(llm, [prefix + _tokens(rng, 5)])
    prompts = [prefix + _tokens(rng, n) for n in (5, 100, 400)] + [_tokens(rng, 30), _tokens(rng, 70)]
    results, cached = _generate(llm, prompts)
    assert cached == [48, 48, 48, 0, 0]
    check_all(prompts, results, arch_reference, "shared prefix")


def test_chat_turns_hit_the_previous_turn(arch_dir: str, arch_reference: HFReference) -> None:
    rng = random.Random(9)
    llm = LLM(arch_dir, dtype="float32", max_model_len=512, block_size=BS)
    history: list[int] = []
    for turn in range(3):
        prompt = history + _tokens(rng, 20 + 7 * turn)
        (result,), (cached,) = _generate(llm, [prompt])
        # The previous turn computed all of its prompt and output but the last sampled token.
        expected = min((len(history) - 1) // BS, (len(prompt) - 1) // BS) * BS if history else 0
        assert cached == expected
        check_all([prompt], [result], arch_reference, f"turn {turn}")
        history = prompt + result[0]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_hits_with_expert_paging_and_preemption(arch: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(f"{arch}_dir")
    rng = random.Random(10)
    prefix = _tokens(rng, 4 * BS)
    prompts = [prefix + _tokens(rng, n) for n in (3, 20, 40, 9)]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    plain = LLM(model, dtype="float32", max_model_len=128, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    # 16 blocks of 16 tokens: the 4 requests (up to 120 tokens each) cannot all fit, so some are
    # preempted and re-admitted, hitting their own freed blocks or the shared prefix.
    llm = LLM(model, dtype="float32", max_model_len=128, expert_budget=0.5,
              kv_cache_memory_bytes=16 * plain.llm_engine.kv_cache_block_bytes)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.prefix_cache_stats()["hits"] > 0 and llm.expert_stats()["misses"] > 0
    kv = llm.llm_engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_prefix_caching_off(arch: str, request: pytest.FixtureRequest) -> None:
    llm = LLM(request.getfixturevalue(f"{arch}_dir"), dtype="float32", max_model_len=128, enable_prefix_caching=False)
    prompt = {"prompt_token_ids": list(range(100, 140))}
    llm.generate(prompt, SamplingParams(max_tokens=2))
    assert llm.generate(prompt, SamplingParams(max_tokens=2))[0].num_cached_tokens == 0
    stats = llm.prefix_cache_stats()
    assert stats["enabled"] is False and stats["queries"] == 0 and "checkpoints_device" not in stats


# ---- property test: the block pool under random admissions, computes and frees ----------------

OPS = st.lists(st.tuples(st.sampled_from(["admit", "compute", "free"]), st.integers(0, 5), st.integers(1, 40)),
               min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(3, 12))
def test_block_pool_never_leaks_or_evicts_held_blocks(ops: list[tuple[str, int, int]], num_blocks: int) -> None:
    kv = KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=True)
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]
    live: dict[str, tuple[list[int], int]] = {}  # request id -> (tokens, computed)
    contents: dict[int, tuple[int, ...]] = {}  # block id -> the tokens it holds, while held
    for op, who, n in ops:
        rid = f"r{who}"
        if op == "admit" and rid not in live:
            tokens = prefixes[who % 3] + list(range(who * 100, who * 100 + n))
            hits = kv.get_computed_blocks(rid, tokens)
            assert len(hits) * 4 <= len(tokens) - 1
            for i, b in enumerate(hits):  # a hit block holds exactly the tokens it stands for
                if b in contents:
                    assert contents[b] == tuple(tokens[i * 4:(i + 1) * 4])
            if kv.allocate_slots(rid, len(hits) * 4 + 1, hits):
                live[rid] = (tokens, len(hits) * 4)
        elif op == "compute" and rid in live:
            tokens, done = live[rid]
            upto = min(len(tokens), done + n)
            if kv.allocate_slots(rid, upto):
                kv.cache_blocks(rid, tokens, upto)
                live[rid] = (tokens, upto)
                for i, b in enumerate(kv.block_table(rid)[: upto // 4]):
                    contents[b] = tuple(tokens[i * 4:(i + 1) * 4])
        elif op == "free" and rid in live:
            kv.free(rid)
            del live[rid]
        held = {b for r in live for b in kv.block_table(r)}
        assert sum(kv.ref_count(b) for b in range(num_blocks)) == sum(len(kv.block_table(r)) for r in live)
        assert kv.num_free_blocks == num_blocks - len(held)  # no leak, no held block in the free queue
        for r in live:  # a held block was never taken by another request for new tokens
            for i, b in enumerate(kv.block_table(r)[: live[r][1] // 4]):
                assert contents[b] == tuple(live[r][0][i * 4:(i + 1) * 4])
    for r in list(live):
        kv.free(r)
    assert kv.num_free_blocks == num_blocks and all(kv.ref_count(b) == 0 for b in range(num_blocks))


@pytest.mark.parametrize("flag,enabled", [([], True), (["--no-enable-prefix-caching"], False)])
def test_cli_flag(flag: list[str], enabled: bool) -> None:
    from moestream.config import EngineConfig
    from moestream.engine.args import engine_kwargs
    from moestream.server.cli import build_parser

    assert EngineConfig(**engine_kwargs(build_parser().parse_args(["serve", *flag]))).enable_prefix_caching is enabled


def test_server_reports_cached_tokens(live_server) -> None:
    from conftest import API_KEY, SERVED_MODEL

    from test_server_hardening import _counter

    body = {"model": SERVED_MODEL, "prompt": "prefix caching " * 20 + "once", "max_tokens": 2, "temperature": 0}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    hits_before = _counter(live_server, "moestream:prefix_cache_hits_total")
    first = live_server.post("/v1/completions", json=body, headers=headers).json()["usage"]
    second = live_server.post("/v1/completions", json=body, headers=headers).json()["usage"]
    n = first["prompt_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16 > 0
    live_server.wait_idle()
    assert _counter(live_server, "moestream:prefix_cache_hits_total") == hits_before + (n - 1) // 16 * 16


def test_periodic_stats_line(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from moestream.server.async_engine import EngineSnapshot, log_stats

    caplog.set_level(logging.INFO, logger="moestream.server.async_engine")
    snap = EngineSnapshot(num_running=2, num_waiting=1, num_blocks=10, num_free_blocks=6,
                          prefix_cache_stats={"enabled": True, "queries": 200, "hits": 50})
    assert log_stats(snap, (100, 0)) == (200, 50)
    assert caplog.messages == ["running 2, waiting 1 requests; KV cache 40.0% used; prefix cache hit rate 25.0% "
                               "(50.0% since the last line)"]
    assert log_stats(snap, (200, 50)) == (200, 50) and len(caplog.messages) == 1  # nothing new: no line
