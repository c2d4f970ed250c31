"""`draft_experts` self-speculation: the model drafts greedily with each MoE layer routed
only to experts on the device, then verifies with the full model. Greedy output under a 25%
expert budget equals the resident run's on five architectures (gpt-oss with its
sliding-window KV group among them), with acceptance reported; with every expert resident the draft pass is the full model, so every draft is
accepted (a check of its KV writes and, on hybrid models, its state copy); the draft's
unrestricted routing is handed to the prefetcher; no block, slot or row leaks."""

from __future__ import annotations

import time

import pytest
from test_spec_decode import NEW, _prompts

from moestream import LLM, SamplingParams

SPEC = {"method": "draft_experts", "num_speculative_tokens": 3, "adaptive": False}


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


_OFF: dict[str, list[list[int]]] = {}


def _off(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs with speculation off (computed once per checkpoint for this module)."""
    if model_dir not in _OFF:
        _OFF[model_dir] = _run(LLM(model_dir, dtype="float32", max_model_len=256), prompts)
    return _OFF[model_dir]


def _no_leaks(llm: LLM) -> None:
    engine = llm.llm_engine
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and not engine.requests
    if engine.state_pool is not None:
        assert engine.state_pool.num_resident() == 0


# one model per MoE block and mixer (Qwen3.5-MoE would repeat Qwen3-Next's GDN and MoE block)
@pytest.fixture(params=["qwen3_moe", "mixtral", "qwen3_next", "gpt_oss", "granite", "nemotron_h", "kimi_linear"])
def any_model(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"{request.param}_dir")


def test_exact_under_a_quarter_budget(any_model: str) -> None:
    prompts = _prompts()
    want = _off(any_model, prompts)
    llm = LLM(any_model, dtype="float32", max_model_len=256, expert_budget=0.25, speculative_config=SPEC)
    assert _run(llm, prompts) == want
    st = llm.spec_decode_stats()
    print(st)
    assert st["num_drafts"] > 0 and 0 < st["acceptance_rate"] < 1  # resident experts only: some drafts miss
    assert llm.expert_stats()["misses"] > 0
    _no_leaks(llm)


def test_every_draft_accepted_when_all_experts_are_resident(any_model: str) -> None:
    """With every expert on the device the draft pass computes what the model computes, so
    the full model accepts each draft: 3 per drafted step, save where max_tokens cuts it."""
    prompts = _prompts()
    want = _off(any_model, prompts)
    llm = LLM(any_model, dtype="float32", max_model_len=256, speculative_config=SPEC)
    assert _run(llm, prompts) == want
    st = llm.spec_decode_stats()
    # Each request: drafts of 3 at n = 1, 5, ..., 25, then 2 at n = 29 (max_tokens 32).
    assert (st["num_drafts"], st["num_draft_tokens"]) == (8 * len(prompts), (7 * 3 + 2) * len(prompts))
    assert st["num_accepted_tokens"] == st["num_draft_tokens"]
    _no_leaks(llm)


def test_draft_routing_feeds_the_prefetcher(qwen3_moe_dir: str) -> None:
    """The draft pass hints the experts the full router picks that are not on the device:
    each hint names a non-resident expert, and loads it started are hit later. It gives the
    policy the full router's choice as a retention hint, resident experts included."""
    llm = LLM(qwen3_moe_dir, dtype="float32", max_model_len=256, expert_budget=0.25, expert_prefetch="gate",
              expert_policy="next_use", speculative_config=SPEC)
    store = llm.llm_engine.expert_store
    store.prefetch_target = "slots"  # CPU devices default to page-cache read-ahead; this checks slot loads
    hints: list[tuple[int, int]] = []
    retained: list[tuple[int, int]] = []
    prefetch, on_hint = store.prefetch, store.policy.on_hint
    store.policy.on_hint = lambda keys: (retained.extend(keys), on_hint(keys))

    def spy(layer: int, ids) -> None:  # this store's hints go through the test first
        import inspect

        from moestream.spec_decode.draft_experts import ResidentOnlyExecutor

        draft = isinstance(inspect.stack()[1].frame.f_locals.get("self"), ResidentOnlyExecutor)
        if draft:  # a draft pass
            resident = store.resident_experts()
            assert all((layer, e) not in resident for e in ids)
            hints.extend((layer, e) for e in ids)
        prefetch(layer, ids)
        # Give the prefetch thread up to 50 ms to start these loads: on a busy machine (beside
        # another pytest-xdist worker) it may not run before the layer is reached, and the
        # layer's pending prefetches are dropped then, leaving no prefetch hit to count.
        deadline = time.monotonic() + 0.05
        keys = [(layer, int(e)) for e in ids]
        while draft and time.monotonic() < deadline:
            with store._queue.lock:
                if all(k in store._slot_of or k in store._loading for k in keys):
                    break
            time.sleep(0.002)

    store.prefetch = spy
    want = _run(LLM(qwen3_moe_dir, dtype="float32", max_model_len=256), _prompts()[:4])
    assert _run(llm, _prompts()[:4]) == want
    assert hints and llm.expert_stats()["prefetch_hits"] > 0
    assert set(hints) < set(retained)  # retention hints also name experts that were resident
    _no_leaks(llm)


def test_draft_executor_swap_is_undone_on_error(qwen3_moe_dir: str) -> None:
    """`resident_only_experts` swaps every MoE layer's executor for the draft pass and puts
    each layer's own back on exit, also when the pass raises."""
    import pytest

    from moestream.layers.moe import SparseMoE
    from moestream.spec_decode.draft_experts import ResidentOnlyExecutor, resident_only_experts

    model = LLM(qwen3_moe_dir, dtype="float32", max_model_len=64).llm_engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    own = [m.experts for m in layers]
    with pytest.raises(RuntimeError, match="draft failed"):
        with resident_only_experts(model):
            assert layers and all(isinstance(m.experts, ResidentOnlyExecutor) for m in layers)
            raise RuntimeError("draft failed")
    assert all(m.experts is e for m, e in zip(layers, own))
