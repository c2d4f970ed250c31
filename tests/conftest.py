"""Session fixtures: tiny random checkpoints (fixed seed) and cached HF float32 references."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
import torch
from live_server import LiveServer
from tiny_checkpoint import make_tiny_checkpoint

from moestream import LLM, EngineConfig
from moestream.server.serving import ServerConfig

# Mixtral's fixture sets a sliding window shorter than prompt + output, so the window matters.
MIXTRAL_SLIDING_WINDOW = 24
PROMPT_LENGTHS = (1, 3, 7, 12, 18, 25, 33, 40)
NUM_NEW_TOKENS = 32


@pytest.fixture(scope="session")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3_moe")), "qwen3_moe", seed=0)


@pytest.fixture(scope="session")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(
        str(tmp_path_factory.mktemp("mixtral")), "mixtral", seed=1, sliding_window=MIXTRAL_SLIDING_WINDOW
    )


@pytest.fixture(scope="session")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """gpt-oss: 4 layers alternating a 16-token sliding window and full attention."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("gpt_oss")), "gpt_oss", seed=3)


@pytest.fixture(scope="session", params=["qwen3_moe", "mixtral"])
def model_dir(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(scope="session")
def qwen3_next_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3_next")), "qwen3_next", seed=2)


@pytest.fixture(scope="session")
def qwen3_5_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3_5_moe")), "qwen3_5_moe", seed=3)


@pytest.fixture(scope="session")
def granite_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("granite")), "granitemoehybrid", seed=4)


@pytest.fixture(scope="session")
def nemotron_h_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("nemotron_h")), "nemotron_h", seed=5)


@pytest.fixture(scope="session")
def kimi_linear_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("kimi_linear")), "kimi_linear", seed=6)


# One model per hybrid family and mixer (Qwen3.5-MoE would repeat Qwen3-Next's Gated DeltaNet
# and MoE block; its own parity and layout are tested in test_hybrid.py and the multimodal tests).
HYBRID_MODELS = ["qwen3_next", "granite", "nemotron_h", "kimi_linear"]


@pytest.fixture(scope="session", params=HYBRID_MODELS)
def hybrid_dir(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(scope="session")
def hf_reference_of() -> "Callable[[str], HFReference]":
    """The session's HFReference of a checkpoint directory (built once, its results cached)."""
    refs: dict[str, HFReference] = {}

    def get(model_dir: str) -> HFReference:
        if model_dir not in refs:
            refs[model_dir] = HFReference(model_dir)
        return refs[model_dir]

    return get


@pytest.fixture(scope="session")
def hybrid_reference(hybrid_dir: str, hf_reference_of) -> "HFReference":
    return hf_reference_of(hybrid_dir)


def count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Wrap module.name so that the returned calls[0] counts its calls."""
    calls = [0]
    real = getattr(module, name)

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def parity_prompts(vocab_limit: int = 30000, seed: int = 1234) -> list[list[int]]:
    """8 prompts of token ids with lengths 1..40."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_limit) for _ in range(n)] for n in PROMPT_LENGTHS]


class HFReference:
    """HF transformers float32 greedy results, one prompt at a time, cached per prompt."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self._cache: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}

    def generate(self, prompt: list[int], max_new_tokens: int = NUM_NEW_TOKENS) -> tuple[list[int], torch.Tensor]:
        """(greedy token ids, raw logits [n, V] float32 at each generated position)."""
        key = tuple(prompt)
        if key not in self._cache:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
            tokens = out.sequences[0, len(prompt) :].tolist()
            self._cache[key] = (tokens, torch.stack([x[0] for x in out.logits]).float())
        return self._cache[key]


@pytest.fixture(scope="session")
def hf_reference(model_dir: str) -> HFReference:
    return HFReference(model_dir)


SERVED_MODEL = "tiny-qwen3-moe"
API_KEY = "test-key"
SERVER_MAX_MODEL_LEN = 128


@pytest.fixture(scope="session")
def live_server(qwen3_moe_dir: str) -> Iterator[LiveServer]:
    """A live server (real uvicorn, 127.0.0.1, free port) over the tiny Qwen3-MoE, float32,
    with an API key and a 64 KiB body limit."""
    server = LiveServer(
        EngineConfig(model=qwen3_moe_dir, dtype="float32", max_model_len=SERVER_MAX_MODEL_LEN, max_num_seqs=64),
        ServerConfig(served_model_names=(SERVED_MODEL, "alias"), api_key=API_KEY, max_request_body_bytes=64 << 10,
                     max_waiting_requests=256),
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def offline_llm(qwen3_moe_dir: str) -> LLM:
    """The offline LLM over the same checkpoint and settings as `live_server`."""
    return LLM(model=qwen3_moe_dir, dtype="float32", max_model_len=SERVER_MAX_MODEL_LEN)
