"""The built-in demo model: ships in the installed package, matches HF greedy, and its loss
on a fixed held-out text stays under the bound recorded at training time."""

from __future__ import annotations

import json
import os

import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.demo import demo_model_path

HELDOUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "demo_heldout.txt")


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    return LLM(demo_model_path(), dtype="float32", max_model_len=1024)


def test_demo_model_ships_in_the_package() -> None:
    import moestream

    path = demo_model_path()
    assert path.startswith(os.path.dirname(moestream.__file__))
    for f in ("config.json", "model.safetensors", "tokenizer.json", "training_metrics.json"):
        assert os.path.isfile(os.path.join(path, f)), f
    assert os.path.getsize(os.path.join(path, "model.safetensors")) < 25 * 2**20


def test_greedy_matches_hf(demo_llm: LLM) -> None:
    """Plain greedy, and greedy with the defaults of the demo's generation_config.json
    (repetition_penalty 1.3), which HF's generate applies by default too."""
    from transformers import AutoModelForCausalLM

    prompt = "def fibonacci(n):"
    hf = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    ids = torch.tensor([demo_llm.get_tokenizer().encode(prompt)])

    ours = demo_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].token_ids
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                      repetition_penalty=1.0)[0, ids.shape[1]:]
    assert ours == ref.tolist()

    defaults = demo_llm.get_default_sampling_params()
    assert defaults.repetition_penalty == hf.generation_config.repetition_penalty == 1.3
    defaults.temperature, defaults.max_tokens = 0.0, 24
    ours = demo_llm.generate([prompt], defaults)[0].outputs[0].token_ids
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    assert ours == ref.tolist()


def test_heldout_loss_under_training_bound(demo_llm: LLM) -> None:
    """Teacher-forced through the engine's own decode path: a logits processor records the
    target's log-probability from the raw logits, then forces the target token."""
    with open(os.path.join(demo_model_path(), "training_metrics.json")) as f:
        bound = json.load(f)["fixed_text_loss"]
    ids = demo_llm.get_tokenizer().encode(open(HELDOUT).read())
    nll: list[float] = []

    def teacher(out_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        target = ids[1 + len(out_ids)]
        nll.append(-torch.log_softmax(logits, -1)[target].item())
        forced = torch.full_like(logits, float("-inf"))
        forced[target] = 0.0
        return forced

    out = demo_llm.generate({"prompt_token_ids": ids[:1]},
                            SamplingParams(temperature=0, max_tokens=len(ids) - 1, ignore_eos=True, logits_processors=[teacher]))
    assert out[0].outputs[0].token_ids == ids[1:]
    loss = sum(nll) / len(nll)
    print(f"held-out loss {loss:.4f} (bound {bound:.4f})")
    assert loss <= bound + 1e-3
