"""Offloading changes time, never numbers: greedy tokens and logits under a paged expert
store equal the fully resident engine bit for bit (torch.equal), at every budget, policy
and prefetch mode; and the store's bookkeeping is exact."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import parity_prompts
from parity import LogitsRecorder

from moestream.models.hf_config import model_config_from_hf
from moestream import LLM, SamplingParams

MAX_TOKENS = 12


def run(model_dir: str, **kw) -> tuple[list[list[int]], list[list[torch.Tensor]], LLM]:
    llm = LLM(model_dir, dtype="float32", max_model_len=96, **kw)
    prompts = parity_prompts()
    recs = [LogitsRecorder() for _ in prompts]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logits_processors=[r]) for r in recs],
    )
    return [o.outputs[0].token_ids for o in outs], [r.logits for r in recs], llm


def expert_bytes(model_dir: str) -> int:
    cfg = model_config_from_hf(model_dir)
    return 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4


@pytest.fixture(scope="module")
def resident(model_dir: str) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    tokens, logits, llm = run(model_dir)
    assert llm.expert_stats()["resident"] is True
    return tokens, logits


BUDGETS = ["50%", "25%", "min"]
POLICIES = ["lru", "lfu", "activation", "next_use"]
PREFETCH = ["none", "gate", "history"]


@pytest.mark.parametrize("budget, policy, prefetch, host, direct", [
    ("50%", "lru", "none", False, "off"),
    *[("25%", p, "none", False, "auto") for p in POLICIES],
    ("min", "lru", "none", False, "auto"),  # at the minimum budget eviction has little choice
    ("min", "next_use", "none", False, "on"),  # and nearly every access is a miss: read with O_DIRECT
    ("25%", "lru", "gate", False, "on"),  # O_DIRECT: the gate's predictions are read into slots
    *[(b, "lru", f, False, "auto") for b, f in itertools.product(BUDGETS, PREFETCH[1:])],
    ("25%", "next_use", "gate", True, "auto"),  # a host cache holding every expert: misses computed in place
])
def test_bit_exact_at_any_budget(model_dir: str, resident, budget: str, policy: str, prefetch: str, host: bool,
                                 direct: str) -> None:
    cfg = model_config_from_hf(model_dir)
    value = {"50%": 0.5, "25%": 0.25, "min": cfg.num_experts_per_tok * expert_bytes(model_dir)}[budget]
    host_bytes = cfg.num_experts * sum(cfg.moe_layers) * expert_bytes(model_dir) if host else 0
    tokens, logits, llm = run(model_dir, expert_budget=value, expert_policy=policy, expert_prefetch=prefetch,
                              expert_host_cache_bytes=host_bytes, expert_direct_io=direct)
    stats = llm.expert_stats()
    assert stats["resident"] is False and stats["policy"] == policy and stats["prefetch"] == prefetch
    assert stats["direct_io"] == (direct == "on")  # auto: these checkpoints fit in the page cache
    ref_tokens, ref_logits = resident
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert stats["misses"] > 0 and stats["evictions"] > 0
    in_place = stats["host_computed"]
    assert stats["bytes_read"] >= (stats["misses"] - in_place) * stats["expert_bytes"] - stats["prefetch_bytes"]
    assert (in_place > 0) == host  # CPU: a host-cache miss is computed where it lies, never copied
    if host:
        assert stats["bytes_read_per_tier"]["host"] == 0
    if budget == "min":
        assert stats["num_slots"] == cfg.num_experts_per_tok
    print(f"{budget} {policy} {prefetch}: hit rate {stats['hit_rate']:.3f}, stall {stats['stall_seconds']:.3f}s, "
          f"prefetch hits {stats['prefetch_hits']}, wasted {stats['wasted_prefetch_bytes']} B")


def test_full_budget_is_resident(model_dir: str) -> None:
    llm = LLM(model_dir, dtype="float32", max_model_len=96, expert_budget=1.0)
    assert llm.expert_stats()["resident"] is True


def test_budget_below_minimum_names_it(qwen3_moe_dir: str) -> None:
    eb = expert_bytes(qwen3_moe_dir)
    with pytest.raises(ValueError, match=f"the minimum budget is {2 * eb} bytes"):
        LLM(qwen3_moe_dir, dtype="float32", expert_budget=2 * eb - 1)
    with pytest.raises(ValueError, match="not a fraction in"):
        LLM(qwen3_moe_dir, dtype="float32", expert_budget=1.5)
    with pytest.raises(ValueError, match="unknown expert prefetch mode"):
        LLM(qwen3_moe_dir, dtype="float32", expert_budget=0.5, expert_prefetch="psychic")
