"""Looped MoE (`loop-moe`, Foil): float32 parity with an independent oracle written from the
reference (tests/loop_moe_reference.py: no cache, the prefix recomputed per token), with
per-pass and shared attention; the unrolled layer axis (one KV cache per (layer, pass),
the stack's parameters held once); paging, prefix hits and speculation bit-exact against
the resident run; chunked prefill, preemption and verified drafts (exact accepted counts) equal to
float32 rounding; config errors naming the field."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from loop_moe_reference import LoopMoEReference
from moestream import LLM, SamplingParams
from moestream.models.hf_config import model_config_from_hf
from parity import LogitsRecorder, greedy_params
from scripted_proposer import ScriptedProposer
from tiny_checkpoint import LOOP_MOE, make_loop_moe_checkpoint

PROMPTS = [[1, 415, 2936, 9060, 285, 1142], [1, 822, 285, 28732, 28744], [1, 22557, 28725, 1526, 28808] * 8,
           [1, 851, 349, 264, 1369, 302, 272, 3798, 4605, 28723], [1, 28705, 13, 1270, 2774], [1, 3195, 28747] * 5,
           [1, 9884, 1693, 28723, 330, 2005], [1] + list(range(300, 340))]
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=[True, False], ids=["per_pass_attention", "shared_attention"])
def loop_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_loop_moe_checkpoint(str(tmp_path_factory.mktemp("loop")), seed=3, per_pass_attention=request.param)


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> list[tuple[list[int], LogitsRecorder]]:
    recs = [LogitsRecorder() for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy_params(r, max_tokens) for r in recs])
    return [(o.outputs[0].token_ids, r) for o, r in zip(outs, recs)]


@pytest.mark.parametrize("layout", [
    dict(per_pass_attention=True, num_head_layers=1, num_tail_layers=1, num_stacks=3),
    dict(per_pass_attention=False, num_head_layers=1, num_tail_layers=1, num_stacks=3),
    dict(per_pass_attention=True, num_head_layers=0, num_tail_layers=0, num_stacks=1),
    dict(per_pass_attention=False, num_head_layers=0, num_tail_layers=1, num_stacks=3),
], ids=["per_pass-h1t1-R3", "shared-h1t1-R3", "per_pass-h0t0-R1", "shared-h0t1-R3"])
def test_greedy_tokens_and_logits_equal_the_reference(tmp_path, layout: dict) -> None:
    """8 prompts x 32 tokens in one batch: the oracle's greedy tokens, logits within 1e-4."""
    d = make_loop_moe_checkpoint(str(tmp_path / "m"), seed=5, **layout)
    ref = LoopMoEReference(d)
    got = _generate(LLM(d, dtype="float32", max_model_len=128), PROMPTS, 32)
    for prompt, (tokens, rec) in zip(PROMPTS, got):
        want, logps = ref.greedy(prompt, 32)
        assert tokens == want
        for logits, ref_logp in zip(rec.logits, logps):
            assert torch.allclose(logits.float().log_softmax(-1), ref_logp, atol=1e-4)


def test_routing_trace_records_each_pass_and_replays(loop_dir: str, tmp_path) -> None:
    """The recorded (layer, pass, experts) of every token equal the oracle's routing, in the
    order the layers ran; trace-sim replays the trace."""
    from moestream.experts.policy import make_policy
    from moestream.experts.trace import RoutingTrace
    from moestream.experts.trace_sim import simulate

    path = str(tmp_path / "routing.npz")
    llm = LLM(loop_dir, dtype="float32", max_model_len=128, record_routing=path)
    prompt = PROMPTS[3]
    tokens = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
    llm.llm_engine.save_routing_trace()
    trace = RoutingTrace.load(path)
    ref = LoopMoEReference(loop_dir)
    ref.forward(prompt + tokens[:-1])  # every position the engine computed
    stack = [ids for p, ids in ref.routes if p.startswith("model.stack")]  # (pass, layer) in run order
    R, L = LOOP_MOE["num_stacks"], LOOP_MOE["num_layers_in_stack"]
    assert len(trace) == (len(prompt) + len(tokens) - 1) * L * R
    for i in range(len(trace)):
        pos, j = divmod(i, L * R)
        r, l = divmod(j, L)
        assert trace.token[i] == pos and trace.loop_pass[i] == r
        assert trace[i] == (1 + l, tuple(stack[j][pos].tolist()))
    for policy in ("lru", "next_use"):
        res = simulate(trace, make_policy(policy), capacity=8)
        assert res.hits + res.misses == trace.num_key_accesses


def test_unrolled_layers_share_the_stack_and_keep_a_kv_cache_each(loop_dir: str) -> None:
    cfg = model_config_from_hf(loop_dir)
    h, L, R = LOOP_MOE["num_head_layers"], LOOP_MOE["num_layers_in_stack"], LOOP_MOE["num_stacks"]
    per_pass = cfg.loop.per_pass_attention
    assert cfg.num_layers == h + L * R + LOOP_MOE["num_tail_layers"] == 8
    assert [i for i, m in enumerate(cfg.moe_layers) if m] == [1, 2]  # experts keyed by the first pass
    llm = LLM(loop_dir, dtype="float32", max_model_len=128)
    engine = llm.llm_engine
    layers = engine.runner.model.model.layers
    for r in range(R):
        for l in range(L):
            u = h + r * L + l
            assert layers[u].mlp is layers[h + l].mlp and layers[u].mlp.layer_idx == h + l
            assert (layers[u].self_attn is layers[h + l].self_attn) == (not per_pass or r == 0)
    assert layers[0].mlp.experts_w1.shape == (8, 64, 32)  # head and tail: 8 experts
    # parameters held once: exactly the checkpoint's tensors (less the rotary tables), experts in the store
    from safetensors import safe_open

    with safe_open(os.path.join(loop_dir, "model.safetensors"), "pt") as f:
        stored = {n: f.get_slice(n).get_shape() for n in f.keys() if not n.endswith("rope.rotations")}
    stack_experts = sum(torch.Size(s).numel() for n, s in stored.items() if n.startswith("model.stack") and "experts_w" in n)
    dense = sum(p.numel() for p in engine.runner.model.parameters())
    assert dense + stack_experts == sum(torch.Size(s).numel() for s in stored.values())
    assert len(engine.runner.kv_caches) == 8
    assert engine.kv_cache_bytes_per_token == 8 * 2 * 64 * 4  # 8 unrolled layers x (K, V) x 64 dims x float32
    paged = LLM(loop_dir, dtype="float32", max_model_len=128, expert_budget=0.25).llm_engine.expert_store
    assert paged.moe_layers == [1, 2] and paged.num_slots == 8  # 25% of 2 x 16 experts: passes share them


def test_paging_prefix_hits_chunked_prefill_and_speculation_are_bit_exact(loop_dir: str) -> None:
    cfg = model_config_from_hf(loop_dir)
    resident = _generate(LLM(loop_dir, dtype="float32", max_model_len=128, enable_prefix_caching=False), PROMPTS)
    min_budget = cfg.num_experts_per_tok * cfg.expert_numel * 4
    runs = {
        "25%": dict(expert_budget=0.25),
        "minimum": dict(expert_budget=min_budget),
        "chunked": dict(max_num_batched_tokens=8),
        "preempted": dict(kv_cache_memory_bytes=12 * 16 * 4096),  # 12 blocks of 16 tokens: too few for all
        "drafts": dict(expert_budget=0.25, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                               "adaptive": False}),
    }
    for name, kw in runs.items():
        llm = LLM(loop_dir, dtype="float32", max_model_len=128, **kw)
        if name == "drafts":  # drafts right for (i + n) % 4 positions, wrong after: every accept length occurs
            drafter = ScriptedProposer([(p, t) for p, (t, _) in zip(PROMPTS, resident)], lambda i, n: (i + n) % 4,
                                       cfg.vocab_size)
            llm.llm_engine.proposer = drafter
        block = llm.llm_engine.config.block_size
        for sighting in range(2):  # the second sighting hits the prefix cache
            got = _generate(llm, PROMPTS)
            if name != "preempted":  # (a preempted request's recompute may hit its own blocks too)
                # the second sighting hits every full block of each prompt but the one holding its last token
                want_hits = sighting * sum((len(p) - 1) // block * block for p in PROMPTS)
                assert llm.llm_engine.prefix_cache_stats()["hits"] == want_hits == 64 * sighting, (name, sighting)
            for (ta, ra), (tb, rb) in zip(resident, got):
                assert ta == tb, (name, sighting)
                if name in ("chunked", "drafts", "preempted"):  # other positions per forward: float32 rounding
                    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ra.logits, rb.logits)), sighting
                else:
                    assert all(torch.equal(a, b) for a, b in zip(ra.logits, rb.logits)), (name, sighting)
        assert llm.llm_engine.prefix_cache_stats()["hits"] > 0  # preempted: 12 blocks, some hits evicted
        if name == "drafts":
            want = [drafter.expected(i, NEW_TOKENS, 3) for i in range(len(PROMPTS))]
            stats = llm.spec_decode_stats()
            assert (stats["num_drafts"], stats["num_accepted_tokens"]) == (2 * sum(d for d, _ in want),
                                                                           2 * sum(a for _, a in want))
        if name in ("25%", "minimum"):
            stats = llm.expert_stats()
            assert stats["misses"] > 0 and stats["resident"] is False
        if name == "minimum":
            assert llm.llm_engine.expert_store.num_slots == cfg.num_experts_per_tok
        if name == "preempted":
            assert llm.llm_engine.scheduler.num_preemptions > 0


def test_ngram_speculation_on_the_looped_demo_is_token_exact() -> None:
    """The trained looped demo on code that repeats itself (a random model's output never
    repeats a token, so the n-gram proposer would find nothing to draft): the same greedy
    tokens with n-gram drafts as without, some drafts accepted."""
    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM("demo-looped", dtype="float32", max_model_len=256).generate([prompt], params)[0].outputs[0].token_ids
    llm = LLM("demo-looped", dtype="float32", max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == plain
    stats = llm.spec_decode_stats()
    print(stats)
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > 0


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.pop("num_stacks"), "num_stacks"),
    (lambda c: c.pop("d_ff"), "d_ff"),
    (lambda c: c.update(num_heads=5), "num_heads"),
    (lambda c: c.update(num_active=3), "num_active"),
    (lambda c: c.update(num_active=9, d_ff=72), "num_active.* more than the 8 experts of a head or tail layer"),
])
def test_a_bad_config_is_refused_naming_the_field(tmp_path, edit, field: str) -> None:
    d = str(tmp_path / "m")
    os.makedirs(d)
    cfg = {**LOOP_MOE, "model_type": "loop-moe"}
    edit(cfg)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=field):
        model_config_from_hf(d)


def test_pass_aware_policy_on_the_looped_demos_trace() -> None:
    """The trained looped demo's routing on held-out text (tests/fixtures/traces/
    demo_looped_heldout.npz, scripts/train_demo_looped.py): replayed at a quarter of the stack's
    experts, the default policy (and its variant told the passes) misses no more often than LRU."""
    from moestream.experts.policy import make_policy
    from moestream.experts.trace import RoutingTrace
    from moestream.experts.trace_sim import BeladyPolicy, future_of, simulate

    trace = RoutingTrace.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "traces",
                                           "demo_looped_heldout.npz"))
    R = int(trace.loop_pass.max()) + 1
    assert R == 4 and set(trace.layer.tolist()) == {1, 2}  # stack layers 1-2 (after one head layer), 4 passes
    slots = 8  # a quarter of 2 layers x 16 experts
    got = {name: simulate(trace, make_policy(name), slots).misses for name in ("next_use", "lru")}
    got["next_use_passes"] = simulate(trace, make_policy("next_use", passes=R), slots).misses
    got["belady"] = simulate(trace, BeladyPolicy(future_of(trace)), slots).misses
    print(f"misses at {slots} slots: {got}")
    assert got["belady"] <= got["next_use"] <= got["lru"] and got["next_use_passes"] <= got["lru"]
