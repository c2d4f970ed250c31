"""Routing traces: file round trip, the DeepSeek loader, the recorder, replay semantics
(property-tested) and policy hit rates against Belady on the real shared trace."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.models.hf_config import model_config_from_hf
from moestream import LLM, SamplingParams
from moestream.experts.policy import (
    POLICY_NAMES,
    EvictionPolicy,
    ExpertKey,
    make_policy,
)
from moestream.experts.trace import RoutingRecorder, RoutingTrace
from moestream.experts.trace_sim import BeladyPolicy, future_of, simulate, trace_sim_main

# The first 60 prompts of ../shared/traces/deepseek_v2_lite_prompt_routing.npz (see fixtures/traces/README.md).
DEEPSEEK_TRACE = str(Path(__file__).resolve().parent / "fixtures" / "traces" / "deepseek_v2_lite_first60.npz")
# The hybrid demo model's routing on held-out text, prompts and generated tokens (scripts/train_demo_hybrid.py).
HYBRID_TRACE = str(Path(__file__).resolve().parent / "fixtures" / "traces" / "demo_hybrid_heldout.npz")


def test_save_load_round_trip(tmp_path) -> None:
    trace = RoutingTrace.from_accesses([(0, (3, 1)), (2, (5,)), (1, ())], request=[0, 0, 1], token=[4, 4, 0])
    for t in (trace, RoutingTrace.from_accesses(list(trace))):
        path = str(tmp_path / "t.npz")
        t.save(path)
        back = RoutingTrace.load(path)
        assert list(back) == [(0, (3, 1)), (2, (5,)), (1, ())]
        assert back.layer.dtype == np.int16 and back.offsets.dtype == np.int64 and back.experts.dtype == np.int16
        if t.request is None:
            assert back.request is None and back.token is None
        else:
            assert back.request.tolist() == [0, 0, 1] and back.token.tolist() == [4, 4, 0]
            assert back.request.dtype == np.int32 and back.token.dtype == np.int32
    assert trace[1] == (2, (5,)) and len(trace) == 3 and trace.num_key_accesses == 3
    with pytest.raises(ValueError):
        RoutingTrace(np.zeros(2), np.array([0, 1]), np.zeros(1))


def test_deepseek_loader() -> None:
    with np.load(DEEPSEEK_TRACE) as z:
        prompts = [z[f"prompt_{1001 + i}"] for i in range(3)]
    trace = RoutingTrace.from_deepseek_npz(DEEPSEEK_TRACE, max_prompts=3)
    assert len(trace) == 26 * sum(len(a) for a in prompts)
    assert trace.num_key_accesses == 6 * len(trace)
    assert [trace[i] for i in range(26)] == [(l, tuple(prompts[0][0, l].tolist())) for l in range(26)]
    # interleave=2: slots take tokens in turn; a finished prompt's slot goes to the next one
    trace = RoutingTrace.from_deepseek_npz(DEEPSEEK_TRACE, interleave=2, max_prompts=3)
    slots, waiting, order = [[0, 0], [1, 0]], [2], []
    while any(slots):
        for i, s in enumerate(slots):
            if s is None and waiting:
                s = slots[i] = [waiting.pop(), 0]
            if s is not None:
                order.append(tuple(s))
                s[1] += 1
                if s[1] == len(prompts[s[0]]):
                    slots[i] = None
    assert trace.request[::26].tolist() == [p for p, _ in order]
    assert trace.token[::26].tolist() == [t for _, t in order]
    assert trace.layer[:52].tolist() == list(range(26)) * 2
    for i, (p, t) in enumerate(order):
        assert trace[26 * i + 7] == (7, tuple(prompts[p][t, 7].tolist()))
    with pytest.raises(ValueError):
        RoutingTrace.from_deepseek_npz(DEEPSEEK_TRACE, interleave=0, max_prompts=1)


def test_recorder() -> None:
    rec = RoutingRecorder()
    rec.begin_step(["a", "a", "b"], [0, 1, 0])  # prefill
    for layer in (0, 1):
        rec.record_layer(layer, torch.tensor([[3, 1], [2, 3], [5, 1]]) + layer)
    rec.record(["b", "a"], [1, 2], 0, torch.tensor([[4, 0], [1, 2]]))  # decode, one layer
    trace = rec.to_trace()
    assert list(trace) == [(0, (3, 1)), (1, (4, 2)), (0, (2, 3)), (1, (3, 4)), (0, (5, 1)), (1, (6, 2)),
                           (0, (4, 0)), (0, (1, 2))]
    assert trace.request.tolist() == [0, 0, 0, 0, 1, 1, 1, 0]
    assert trace.token.tolist() == [0, 0, 1, 1, 0, 0, 1, 2]
    assert list(rec.to_trace(per_step=True)) == [(0, (1, 2, 3, 5)), (1, (2, 3, 4, 6)), (0, (0, 1, 2, 4))]
    rec.record(["a"], [0], 0, torch.tensor([[7, 8]]))  # recomputed token: replaces its record
    assert rec.to_trace()[0] == (0, (7, 8))
    with pytest.raises(ValueError):
        rec.record(["a"], [0, 1], 0, torch.tensor([[1, 2]]))


def test_simulate_semantics() -> None:
    lru = make_policy("lru")
    trace = RoutingTrace.from_accesses([(0, (1, 2)), (1, (1,)), (0, (1, 3))])
    # (0,3) misses on a full pool; (0,1) is protected, so LRU takes (0,2), not (0,1)
    r = simulate(trace, lru, 3)
    assert (r.hits, r.misses, r.evictions) == (1, 4, 1) and r.hit_rate == 0.2
    # waves: 3 experts, 2 slots -> waves (1, 2) and (3,); the second wave may evict the first
    r = simulate(RoutingTrace.from_accesses([(0, (1, 2, 3)), (0, (3,))]), make_policy("lru"), 2)
    assert (r.hits, r.misses, r.evictions) == (1, 3, 1)
    # pinned keys are resident from the start and never evicted
    trace = RoutingTrace.from_accesses([(0, (1,)), (0, (2,)), (0, (3,)), (0, (1,))])
    r = simulate(trace, make_policy("lru"), 2, pinned={(0, 1)})
    assert (r.hits, r.misses, r.evictions) == (2, 2, 1)
    with pytest.raises(ValueError):
        simulate(trace, make_policy("lru"), 1, pinned={(0, 1)})


class Checked(EvictionPolicy):
    """Wraps a policy and checks simulate's contract on every call."""

    def __init__(self, inner: EvictionPolicy, capacity: int, pinned: frozenset[ExpertKey]) -> None:
        self.inner, self.capacity, self.pinned, self.name = inner, capacity, pinned, inner.name
        self.resident: set[ExpertKey] = set()
        self.experts: tuple[int, ...] = ()
        self.layer = self.done = 0

    def on_route(self, layer: int, expert_ids: Sequence[int], weights: Sequence[float]) -> None:
        self.layer, self.experts, self.done = layer, tuple(expert_ids), 0
        self.inner.on_route(layer, expert_ids, weights)

    def on_access(self, key: ExpertKey) -> None:
        self.done += 1
        self.inner.on_access(key)

    def on_insert(self, key: ExpertKey) -> None:
        self.resident.add(key)
        assert len(self.resident) <= self.capacity
        self.inner.on_insert(key)

    def on_evict(self, key: ExpertKey) -> None:
        self.resident.remove(key)
        self.inner.on_evict(key)

    def victim(self, candidates: Collection[ExpertKey], current_layer: int) -> ExpertKey:
        room = self.capacity - len(self.pinned)
        step = room if len(set(self.experts)) > room else len(self.experts)
        start = (self.done - 1) // step * step
        wave = {(self.layer, e) for e in self.experts[start:start + step]}
        assert current_layer == self.layer and len(self.resident) == self.capacity
        assert set(candidates) == self.resident - self.pinned - wave
        out = self.inner.victim(candidates, current_layer)
        assert out in candidates and out not in wave and out not in self.pinned
        if len(set(self.experts)) <= room:
            assert out not in {(self.layer, e) for e in self.experts}  # never a key of the current access
        return out


accesses_st = st.lists(
    st.tuples(st.integers(0, 3), st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True).map(tuple)),
    min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(accesses=accesses_st, capacity=st.integers(2, 8), pinned=st.sets(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=2))
def test_simulate_contract(accesses: list[tuple[int, tuple[int, ...]]], capacity: int, pinned: set[ExpertKey]) -> None:
    pinned = frozenset(pinned) if len(pinned) < capacity else frozenset()
    trace = RoutingTrace.from_accesses(accesses)
    for inner in [make_policy(n) for n in POLICY_NAMES] + [BeladyPolicy(future_of(trace))]:
        r = simulate(trace, Checked(inner, capacity, pinned), capacity, pinned)
        assert r.hits + r.misses == trace.num_key_accesses
        assert r.misses - r.evictions == min(capacity, len({(l, e) for l, ex in accesses for e in ex} | pinned)) - len(pinned)


def test_hybrid_demo_trace_has_prompts_and_generated_tokens() -> None:
    """The hybrid demo's trace: 8 MoE layers x 16 experts, top-2, every step's tokens, the 64
    generated ones included (positions past the 96-token prompts)."""
    trace = RoutingTrace.load(HYBRID_TRACE)
    assert set(trace.layer.tolist()) == set(range(8))
    assert np.all(np.diff(trace.offsets) == 2) and 0 <= trace.experts.min() and trace.experts.max() < 16
    assert trace.token is not None and trace.token.max() == 96 + 64 - 2  # the last sampled token is never fed back
    assert len(set(trace.request.tolist())) == 24


@pytest.mark.parametrize("which", ["deepseek", "hybrid_demo"])
def test_policies_below_belady_on_real_trace(which: str) -> None:
    if which == "deepseek":
        trace, capacities = RoutingTrace.from_deepseek_npz(DEEPSEEK_TRACE, max_prompts=8), (96, 416)
    else:  # 128 (layer, expert) keys
        trace, capacities = RoutingTrace.load(HYBRID_TRACE), (32, 64)
    future = future_of(trace)
    for capacity in capacities:
        best = simulate(trace, BeladyPolicy(future), capacity).hit_rate
        rates = {n: simulate(trace, make_policy(n), capacity).hit_rate for n in POLICY_NAMES}
        print(f"slots {capacity}: " + ", ".join(f"{n} {r:.4f}" for n, r in rates.items()) + f", belady {best:.4f}")
        assert all(r <= best for r in rates.values())
        assert best > 0


def _table(out: list[str]) -> dict[tuple[int, str], tuple[float, int, float]]:
    """(slots, policy) -> (hit rate, misses, misses / Belady's) of trace-sim's table."""
    rows = {}
    for line in out:
        cap, name, rate, misses, ratio = line.split()
        rows[(int(cap), name)] = (float(rate), int(misses), float(ratio))
    return rows


def test_trace_sim_main_table(tmp_path, capsys) -> None:
    """One row per (size, policy): hit rate, misses and the miss ratio to Belady, which equal
    a direct `simulate` of each."""
    path = str(tmp_path / "t.npz")
    accesses = [(i % 3, (i % 5, (i + 1) % 5 + 5)) for i in range(200)]
    RoutingTrace.from_accesses(accesses).save(path)
    assert trace_sim_main([path, "--cache-sizes", "4,0.5", "--jobs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["slots", "policy", "hit", "rate", "misses", "x", "belady"]
    rows = _table(out[2:])
    assert sorted({cap for cap, _ in rows}) == [4, 15]  # 0.5 of 30 distinct keys
    trace = RoutingTrace.from_accesses(accesses)
    for cap in (4, 15):
        best = simulate(trace, BeladyPolicy(future_of(trace)), cap)
        assert rows[(cap, "belady")] == (round(best.hit_rate, 4), best.misses, 1.0)
        for name in POLICY_NAMES:
            r = simulate(trace, make_policy(name), cap)
            assert rows[(cap, name)] == (round(r.hit_rate, 4), r.misses, round(r.misses / best.misses, 3))
            assert rows[(cap, name)][2] >= 1.0
    assert trace_sim_main([path, "--cache-sizes", "6", "--policies", "lru", "--jobs", "2"]) == 0
    assert [k[1] for k in _table(capsys.readouterr().out.splitlines()[2:])] == ["lru", "belady"]
    with pytest.raises(SystemExit):
        trace_sim_main([path, "--policies", "fifo"])


def test_trace_sim_main_deepseek(capsys) -> None:
    args = [DEEPSEEK_TRACE, "--max-prompts", "2", "--interleave", "2", "--cache-sizes", "64", "--jobs", "1"]
    assert trace_sim_main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("trace: ") and set(_table(out[2:])) == {(64, n) for n in (*POLICY_NAMES, "belady")}


def test_serving_path_does_not_import_the_simulator() -> None:
    """The trace format and recorder (imported by the engine) carry no simulator, argparse or
    process pool: a fresh interpreter importing the engine has none of them loaded."""
    import subprocess
    import sys

    code = ("import sys, moestream.engine.llm_engine; "
            "print(sorted(m for m in ('moestream.experts.trace_sim', 'argparse', 'concurrent.futures.process') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "moestream.experts.trace_sim" not in out and "concurrent.futures.process" not in out


def test_hybrid_recording_with_fewer_state_slots_than_requests(hybrid_dir: str, tmp_path) -> None:
    """5 requests, 2 state slots: each step runs in groups of at most 2 requests (one forward
    each), and every forward's rows are recorded under their own (request, position)."""
    prompts = [[(7 * i + 3 * j) % 500 + 10 for j in range(n)] for i, n in enumerate((1, 4, 9, 13, 6))]
    params = SamplingParams(temperature=0.0, max_tokens=7)

    def generate(**kw) -> tuple[LLM, list[list[int]]]:
        llm = LLM(hybrid_dir, dtype="float32", max_model_len=64, **{"max_resident_states": 2, **kw})
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return llm, [list(o.outputs[0].token_ids) for o in outs]

    _, want = generate()
    path = str(tmp_path / "routing.npz")
    llm, got = generate(record_routing=path)
    assert got == want
    llm.llm_engine.save_routing_trace()
    trace = RoutingTrace.load(path)
    mcfg = model_config_from_hf(hybrid_dir)
    moe_layers = [i for i, m in enumerate(mcfg.moe_layers) if m]
    # Computed tokens: the prompt and every output token but the last (sampled, never fed back).
    computed = [len(p) + len(o) - 1 for p, o in zip(prompts, got)]
    assert len(trace) == sum(computed) * len(moe_layers)
    assert trace.num_key_accesses == len(trace) * mcfg.num_experts_per_tok
    records = list(zip(trace.request.tolist(), trace.token.tolist(), trace.layer.tolist()))
    assert sorted(records) == [(r, t, layer) for r, n in enumerate(computed) for t in range(n) for layer in moe_layers]
    # Each row under its own (request, position): the same experts as one forward per step.
    one, _ = generate(record_routing=str(tmp_path / "one.npz"), max_resident_states=None)
    ref = one.llm_engine.recorder.to_trace()
    ref_records = zip(ref.request.tolist(), ref.token.tolist(), ref.layer.tolist())
    assert dict(zip(records, trace)) == dict(zip(ref_records, ref))
    # ... though the 2-slot run made more forwards (MoE layer calls) than the 1-forward-per-step run.
    assert len(llm.llm_engine.recorder.to_trace(per_step=True)) > len(one.llm_engine.recorder.to_trace(per_step=True))
