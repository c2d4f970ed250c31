"""Scheduler decisions on constructed cases (no model)."""

import torch

from moestream.engine.kv_cache import KVCacheManager
from moestream.engine.kv_cache_coordinator import KVCacheCoordinator
from moestream.engine.request import Request, RequestStatus
from moestream.engine.scheduler import Scheduler
from moestream.engine.state_pool import StatePool
from moestream.layers.recurrent_state import StateSpec
from moestream.sampling_params import SamplingParams


def req(rid: str, n: int) -> Request:
    return Request(rid, None, list(range(1, n + 1)), SamplingParams())


def plan(sched: Scheduler) -> list[tuple[str, int]]:
    out = sched.schedule()
    for r, n in out.scheduled:  # what the engine does after the forward pass
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.token_ids.append(7)
    return [(r.request_id, n) for r, n in out.scheduled]


def test_token_budget_chunks_prompts() -> None:
    s = Scheduler(KVCacheCoordinator(KVCacheManager(100, 4)), max_num_seqs=8, max_num_batched_tokens=10)
    for r in (req("a", 7), req("b", 6), req("c", 3)):
        s.add_request(r)
    assert plan(s) == [("a", 7), ("b", 3)]  # b's prompt is chunked
    assert plan(s) == [("a", 1), ("b", 3), ("c", 3)]  # a decodes, b finishes its prompt, c joins
    assert plan(s) == [("a", 1), ("b", 1), ("c", 1)]


def test_max_num_seqs() -> None:
    s = Scheduler(KVCacheCoordinator(KVCacheManager(100, 4)), max_num_seqs=2, max_num_batched_tokens=100)
    for r in (req("a", 2), req("b", 2), req("c", 2)):
        s.add_request(r)
    assert plan(s) == [("a", 2), ("b", 2)]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_preempts_newest_running_request() -> None:
    kv = KVCacheManager(4, 4)  # 16 token slots
    s = Scheduler(KVCacheCoordinator(kv), max_num_seqs=8, max_num_batched_tokens=100)
    a, b = req("a", 8), req("b", 8)  # 2 blocks each: the pool is full
    s.add_request(a)
    s.add_request(b)
    assert plan(s) == [("a", 8), ("b", 8)]
    # a's 9th token needs a third block: b (newest) is preempted, a runs.
    assert plan(s) == [("a", 1)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(s.waiting) == [b] and s.running == [a]
    assert s.num_preemptions == 1
    # b's blocks 2, 3 went back last first (3, then 2), so a's third block is 3.
    assert kv.block_table("a") == [0, 1, 3] and kv.num_free_blocks == 1
    # b comes back (recompute: its 8 prompt tokens + 1 output token) once there is room.
    s.finish_request(a, RequestStatus.FINISHED_STOPPED)
    assert plan(s) == [("b", 9)]
    assert kv.block_table("b") == [2, 3, 1]


def test_request_preempts_itself_when_newest() -> None:
    kv = KVCacheManager(3, 4)
    s = Scheduler(KVCacheCoordinator(kv), max_num_seqs=8, max_num_batched_tokens=100)
    a, b = req("a", 4), req("b", 8)
    s.add_request(a)
    s.add_request(b)
    assert plan(s) == [("a", 4), ("b", 8)]
    # a needs a 2nd block (none free): b is preempted, then a fits.
    assert plan(s) == [("a", 1)]
    assert s.running == [a] and list(s.waiting) == [b]
    # With one running request that cannot grow any more, it preempts itself.
    kv2 = KVCacheManager(1, 4)
    s2 = Scheduler(KVCacheCoordinator(kv2), 8, 100)
    c = req("c", 4)
    s2.add_request(c)
    assert plan(s2) == [("c", 4)]
    assert plan(s2) == []
    assert c.status == RequestStatus.PREEMPTED and kv2.num_free_blocks == 1


def test_finish_aborts_and_frees() -> None:
    kv = KVCacheManager(10, 4)
    s = Scheduler(KVCacheCoordinator(kv), 8, 100)
    a, b = req("a", 9), req("b", 3)
    s.add_request(a)
    s.add_request(b)
    plan(s)
    assert kv.num_free_blocks == 10 - 3 - 1
    s.finish_request(a, RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 10 - 1 and s.running == [b]
    assert a.finish_reason == "abort"
    c = req("c", 2)
    s.add_request(c)
    s.finish_request(c, RequestStatus.FINISHED_ABORTED)  # aborted while waiting
    assert not s.waiting


def test_hybrid_requests_take_turns_on_the_state_slots() -> None:
    """2 state slots, 3 requests: each step runs 2, in round robin (least recently run or
    longest waiting first), and the 2 that run are the resident ones."""
    specs = (StateSpec("conv", (4, 3), torch.float32), StateSpec("ssm", (2, 3, 3), torch.float32))
    pool = StatePool(1, specs, 2, torch.device("cpu"))
    s = Scheduler(KVCacheCoordinator(KVCacheManager(100, 4), pool), max_num_seqs=8, max_num_batched_tokens=100)
    for r in (req("a", 3), req("b", 3), req("c", 3)):
        s.add_request(r)
    assert plan(s) == [("a", 3), ("b", 3)]  # c waits: 2 slots
    assert [r.request_id for r in s.waiting] == ["c"]
    assert plan(s) == [("c", 3), ("a", 1)]  # c has waited longest; then a, which ran before b
    assert plan(s) == [("b", 1), ("c", 1)]
    assert plan(s) == [("a", 1), ("b", 1)]
    assert plan(s) == [("c", 1), ("a", 1)]
    assert {rid for rid in "abc" if pool.is_resident(rid)} == {"c", "a"} and pool.num_swapped() == 1
