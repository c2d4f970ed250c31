"""The built-in demo models ("demo", a Qwen3-MoE; "demo-hybrid", a Qwen3.5-MoE hybrid with an
MTP layer; "demo-looped", a looped MoE): each ships in the installed package, matches HF
greedy (the looped one: the float32 oracle of tests/loop_moe_reference.py, as HF has no
loop-moe), and its loss on a fixed held-out text stays under the bound recorded at training
time; the hybrid's MTP drafts are accepted at least as often as recorded."""

from __future__ import annotations

import json
import os

import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.demo import builtin_model_path, resolve_model

HELDOUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "demo_heldout.txt")
DEMOS = ["demo", "demo-hybrid", "demo-looped"]


@pytest.fixture(scope="module", params=DEMOS)
def demo(request: pytest.FixtureRequest) -> tuple[str, LLM]:
    """(built-in name, its float32 LLM)."""
    return request.param, LLM(request.param, dtype="float32", max_model_len=1024)


def _metrics(name: str) -> dict:
    with open(os.path.join(builtin_model_path(name), "training_metrics.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("name", DEMOS)
def test_demo_model_ships_in_the_package(name: str) -> None:
    import moestream

    path = builtin_model_path(name)
    assert path.startswith(os.path.dirname(moestream.__file__))
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "training_metrics.json"):
        assert os.path.isfile(os.path.join(path, f)), f
    assert os.path.getsize(os.path.join(path, "model.safetensors")) < 25 * 10**6
    assert resolve_model(name) == path and resolve_model("/some/dir") == "/some/dir"
    with pytest.raises(ValueError, match="unknown built-in model 'demo-x'; built-in: demo, demo-hybrid, demo-looped"):
        builtin_model_path("demo-x")


def test_hybrid_demo_is_a_hybrid_with_mtp_and_balanced_experts() -> None:
    from safetensors import safe_open

    path = builtin_model_path("demo-hybrid")
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["model_type"] == "qwen3_5_moe_text" and cfg["shared_expert_intermediate_size"] > 0
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight",
            "mtp.layers.0.mlp.experts.0.gate_proj.weight"} <= names
    skew = _metrics("demo-hybrid")["routing_skew"]  # moestream's own routing of held-out text
    assert len(skew) == 8 and all(r["min_over_mean"] >= 0.2 for r in skew), skew


def test_greedy_matches_hf(demo: tuple[str, LLM]) -> None:
    """32 greedy tokens, plain and with the demo's generation_config.json defaults (which HF's
    generate applies by default too)."""
    from transformers import AutoModelForCausalLM

    name, llm = demo
    prompt = "def fibonacci(n):"
    if name == "demo-looped":
        from loop_moe_reference import LoopMoEReference

        ref_model, ids = LoopMoEReference(builtin_model_path(name)), llm.get_tokenizer().encode(prompt)
        ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].token_ids
        assert ours == ref_model.greedy(ids, 32)[0]
        defaults = llm.get_default_sampling_params()
        assert defaults.repetition_penalty > 1.0
        defaults.temperature, defaults.max_tokens = 0.0, 32
        ours = llm.generate([prompt], defaults)[0].outputs[0].token_ids
        assert ours == ref_model.greedy(ids, 32, defaults.repetition_penalty)[0]
        return
    hf = AutoModelForCausalLM.from_pretrained(builtin_model_path(name), dtype=torch.float32).eval()
    ids = torch.tensor([llm.get_tokenizer().encode(prompt)])

    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].token_ids
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                      repetition_penalty=1.0)[0, ids.shape[1]:]
    assert ours == ref.tolist()

    defaults = llm.get_default_sampling_params()
    assert defaults.repetition_penalty == hf.generation_config.repetition_penalty > 1.0
    defaults.temperature, defaults.max_tokens = 0.0, 32
    ours = llm.generate([prompt], defaults)[0].outputs[0].token_ids
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)[0, ids.shape[1]:]
    assert ours == ref.tolist()


def test_heldout_loss_under_training_bound(demo: tuple[str, LLM]) -> None:
    """Teacher-forced through the engine's own decode path: a logits processor records the
    target's log-probability from the raw logits, then forces the target token."""
    name, llm = demo
    bound = _metrics(name)["fixed_text_loss"]
    ids = llm.get_tokenizer().encode(open(HELDOUT).read())
    nll: list[float] = []

    def teacher(out_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        target = ids[1 + len(out_ids)]
        nll.append(-torch.log_softmax(logits, -1)[target].item())
        forced = torch.full_like(logits, float("-inf"))
        forced[target] = 0.0
        return forced

    out = llm.generate({"prompt_token_ids": ids[:1]},
                       SamplingParams(temperature=0, max_tokens=len(ids) - 1, ignore_eos=True, logits_processors=[teacher]))
    assert out[0].outputs[0].token_ids == ids[1:]
    loss = sum(nll) / len(nll)
    print(f"{name}: held-out loss {loss:.4f} (bound {bound:.4f})")
    assert loss <= bound + 1e-3


def test_hybrid_mtp_acceptance_at_least_recorded() -> None:
    """MTP speculative decoding (k=1) on the fixed held-out text, as the training script
    measures it: 256-token windows every 128 tokens of its first 1024, 64 greedy tokens each."""
    bound = _metrics("demo-hybrid")["mtp_acceptance_k1"]
    llm = LLM("demo-hybrid", dtype="float32", max_model_len=2048,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1, "adaptive": False})
    ids = llm.get_tokenizer().encode(open(HELDOUT).read())
    prompts = [{"prompt_token_ids": ids[i : i + 256]} for i in range(0, min(len(ids), 1024) - 256, 128)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, repetition_penalty=1.0), use_tqdm=False)
    stats = llm.spec_decode_stats()
    print(f"MTP acceptance {stats['acceptance_rate']:.3f} (bound {bound:.3f})")
    assert stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] >= bound - 1e-9
