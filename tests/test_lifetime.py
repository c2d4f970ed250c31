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
