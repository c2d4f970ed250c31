"""Dropping the last reference to an LLM frees its engine and KV cache at once, with the
cycle collector off: nothing the engine owns holds a strong reference back to it."""

import gc
import weakref

from moestream import LLM, SamplingParams


def test_engine_freed_without_gc(qwen3_moe_dir: str) -> None:
    gc.collect()
    gc.disable()
    try:
        llm = LLM(qwen3_moe_dir, dtype="float32", max_model_len=64)
        llm.generate(["free me", "and me"], SamplingParams(temperature=0.5, seed=1, max_tokens=4))
        engine_ref = weakref.ref(llm.llm_engine)
        kv_refs = [weakref.ref(t) for pair in llm.llm_engine.runner.kv_caches for t in pair]
        model_ref = weakref.ref(llm.llm_engine.runner.model)
        store_ref = weakref.ref(llm.llm_engine.expert_store)
        assert engine_ref() is not None and all(r() is not None for r in kv_refs)
        del llm
        assert engine_ref() is None
        assert all(r() is None for r in kv_refs)
        assert model_ref() is None and store_ref() is None
    finally:
        gc.enable()


def test_paged_engine_with_prefetch_thread_freed_without_gc(qwen3_moe_dir: str) -> None:
    import threading
    import time

    gc.collect()
    gc.disable()
    try:
        threads0 = threading.active_count()
        before = set(threading.enumerate())
        llm = LLM(qwen3_moe_dir, dtype="float32", max_model_len=64, expert_budget=0.5, expert_prefetch="gate")
        llm.generate(["page me"], SamplingParams(temperature=0, max_tokens=4))
        names = sorted(t.name for t in set(threading.enumerate()) - before)
        readers = [n for n in names if n.startswith("expert-read")]
        # the prefetch worker, and the demand readers the misses started (at most read_workers)
        assert sorted(readers + ["moestream-prefetch"]) == names and 1 <= len(readers) <= 4
        engine_ref = weakref.ref(llm.llm_engine)
        slot = next(iter(llm.llm_engine.expert_store._views.values()))
        slots_ref = weakref.ref(slot.gate_up._base)  # the stacked [S, 2I, H] slot tensor
        del slot
        del llm
        assert engine_ref() is None and slots_ref() is None
        for _ in range(100):  # the worker notices within its wait and exits
            if threading.active_count() == threads0:
                break
            time.sleep(0.05)
        assert threading.active_count() == threads0
    finally:
        gc.enable()
