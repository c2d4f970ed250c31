"""The `mtp` method: a tiny Qwen3-Next / Qwen3.5-MoE checkpoint with random `mtp.*` weights in
the hub checkpoints' layout (`mtp.fc`, `mtp.pre_fc_norm_{embedding,hidden}`, `mtp.norm`, and
`mtp.layers.0.*` named as a full-attention decoder layer) loads and drafts; greedy output
equals speculation off; the MTP KV cache written step by step equals one written in a single
pass over the whole sequence; a checkpoint without `mtp.*` is refused with a clear error."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_spec_decode import NEW, _prompts

from moestream import LLM, SamplingParams

SPEC = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}


def add_mtp_weights(src: str, dst: str, seed: int = 0) -> str:
    """Copy checkpoint `src` to `dst` and add random MTP weights in the hub layout: the names of
    its last full-attention layer under `mtp.layers.0.`, plus fc, the two pre-fc norms and norm."""
    shutil.copytree(src, dst)
    with safe_open(os.path.join(src, "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."
        full = max(int(n.split(".")[len(prefix.split(".")) ]) for n in names
                   if n.startswith(prefix + "layers.") and ".self_attn." in n)
        layer = f"{prefix}layers.{full}."
        g = torch.Generator().manual_seed(seed)
        out = {}
        for n in names:
            if n.startswith(layer):
                t = f.get_tensor(n)
                norm = n.endswith("norm.weight")
                out["mtp.layers.0." + n[len(layer):]] = (torch.randn(t.shape, generator=g) * (0.1 if norm else 0.05)
                                                         ).to(t.dtype)
        hidden = f.get_tensor(prefix + "norm.weight").shape[0]
    out["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.05
    for n in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        out[n] = torch.randn(hidden, generator=g) * 0.1
    save_file(out, os.path.join(dst, "mtp.safetensors"))
    return dst


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def mtp_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    src = request.getfixturevalue(f"{request.param}_dir")
    return add_mtp_weights(src, str(tmp_path_factory.mktemp("mtp") / request.param))


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_mtp_drafts_and_output_equals_off(mtp_dir: str) -> None:
    prompts = _prompts()[::2]  # 4 parity prompts, 2 repetitive ones
    want = _run(LLM(mtp_dir, dtype="float32", max_model_len=256), prompts)
    llm = LLM(mtp_dir, dtype="float32", max_model_len=256, max_resident_states=3, max_num_batched_tokens=48,
              speculative_config=SPEC)
    assert llm.llm_engine.runner.mtp is not None
    assert _run(llm, prompts) == want
    st = llm.spec_decode_stats()
    print(st)
    # Random MTP weights draft badly, but each continuing step drafts k tokens.
    assert st["num_drafts"] > 0 and st["num_draft_tokens"] > 2 * st["num_drafts"]
    kv = llm.llm_engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and not llm.llm_engine.requests


def test_mtp_cache_written_step_by_step_equals_one_pass(qwen3_next_dir: str, tmp_path) -> None:
    """After a request's prompt (in chunks) and 12 decode steps with drafts, the MTP layer's
    KV at every computed position equals a fresh engine's after one pass over the same
    tokens as a prompt."""
    d = add_mtp_weights(qwen3_next_dir, str(tmp_path / "m"))
    prompt = _prompts()[5]
    llm = LLM(d, dtype="float32", max_model_len=256, max_num_batched_tokens=16, enable_prefix_caching=False,
              speculative_config=SPEC)
    engine = llm.llm_engine
    rid = engine.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(16):
        engine.step()
    req = engine.requests[rid]
    n = req.num_computed_tokens
    table = engine.kv_cache.block_table(rid)
    bs = engine.kv_cache.block_size
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
    got = [c.flatten(0, 1)[slots].clone() for c in engine.runner.mtp_kv]
    tokens = req.token_ids[: n + 1]
    fresh = LLM(d, dtype="float32", max_model_len=256, enable_prefix_caching=False, speculative_config=SPEC).llm_engine
    frid = fresh.add_request({"prompt_token_ids": tokens}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    fresh.step()  # the prompt's n + 1 tokens in one step: MTP rows for positions 0..n-1
    assert fresh.requests[frid].num_computed_tokens == n + 1
    ftable = fresh.kv_cache.block_table(frid)
    fslots = torch.tensor([ftable[p // bs] * bs + p % bs for p in range(n)])
    want = [c.flatten(0, 1)[fslots] for c in fresh.runner.mtp_kv]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_checkpoint_without_mtp_is_refused(qwen3_next_dir: str) -> None:
    with pytest.raises(ValueError, match="needs the checkpoint's multi-token-prediction weights"):
        LLM(qwen3_next_dir, dtype="float32", max_model_len=64, speculative_config=SPEC)
