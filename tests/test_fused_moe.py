"""The fused CPU MoE kernel (moestream/kernels/fused_moe.py): values against a float64
oracle written from the definition, an expert's output independent of the rows around it,
the engine's use of it (resident and paged agree bit for bit, HF parity with the PyTorch
path as well), and the fallback when it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_NEW_TOKENS, HFReference, parity_prompts
from parity import LogitsRecorder, check_all, greedy_params

import moestream.layers.expert_executor as executor_module
from moestream import LLM
from moestream.config import EngineConfig, ExpertActivation
from moestream.engine import builder
from moestream.engine.builder import use_fused_moe
from moestream.experts.interface import ExpertWeights
from moestream.kernels import fused_moe as kernel
from moestream.layers.expert_executor import _loop, fused_applies, sort_by_expert

OAI = ExpertActivation("swigluoai", alpha=1.702, limit=7.0, bias=True)


def _case(t: int, h: int, i: int, e: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    gate_up = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    down = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    bias = ((torch.randn(e, 2 * i, generator=g) * 0.1).to(dtype), (torch.randn(e, h, generator=g) * 0.1).to(dtype))
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, k] distinct per token
    weights = torch.rand(t, k, generator=g)
    return x, gate_up, down, bias, ids, weights


def _run_kernel(x, gate_up, down, bias, ids, weights, act: ExpertActivation) -> torch.Tensor:
    order, token_of, counts = sort_by_expert(ids, gate_up.shape[0])
    cl = counts.tolist()
    active = [e for e, c in enumerate(cl) if c]
    b = ([bias[0][e] for e in active], [bias[1][e] for e in active]) if act.bias else None
    out = torch.zeros(x.shape, dtype=torch.float32)
    return kernel.fused_moe(x, [gate_up[e] for e in active], [down[e] for e in active], b, token_of,
                            weights.flatten()[order].contiguous(), [cl[e] for e in active],
                            kernel.ACT_CODES[act.name], act.alpha, act.limit, out)


def _oracle(x, gate_up, down, bias, ids, weights, act: ExpertActivation) -> torch.Tensor:
    """float64, token by token, from the definition (SwiGLU; gpt-oss's clamped form)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = gate_up[e].double() @ x[t].double()
            if act.bias:
                h = h + bias[0][e].double()
            if act.name == "silu":
                gate, up = h.chunk(2)
                a = F.silu(gate) * up
            else:
                gate, up = h[0::2].clamp(max=act.limit), h[1::2].clamp(-act.limit, act.limit)
                a = (up + 1) * gate * torch.sigmoid(act.alpha * gate)
            y = down[e].double() @ a
            if act.bias:
                y = y + bias[1][e].double()
            out[t] += float(weights[t, j]) * y
    return out


@pytest.mark.parametrize("shape", [(3, 64, 32, 8, 2), (5, 70, 19, 8, 3), (16, 96, 40, 12, 4)])
@pytest.mark.parametrize("act", [ExpertActivation(), OAI], ids=["silu", "swigluoai"])
def test_float32_matches_the_oracle(shape: tuple, act: ExpertActivation) -> None:
    """Widths that are and are not multiples of the SIMD step (the scalar tails)."""
    case = _case(*shape, torch.float32)
    got = _run_kernel(*case, act)
    want = _oracle(*case, act)
    assert (got.double() - want).abs().max() < 2e-5 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("act", [ExpertActivation(), OAI], ids=["silu", "swigluoai"])
def test_bf16_as_close_to_the_oracle_as_the_torch_path(act: ExpertActivation) -> None:
    """bf16 rounds after each op as torch does, so its error is the PyTorch path's."""
    case = _case(12, 128, 64, 8, 3, torch.bfloat16, seed=3)
    x, gate_up, down, bias, ids, weights = case
    want = _oracle(*case, act)
    order, token_of, counts = sort_by_expert(ids, 8)
    cl = counts.tolist()
    active = [e for e, c in enumerate(cl) if c]
    torch_path = _loop(x, token_of, weights.flatten()[order], cl, active, lambda e: ExpertWeights(gate_up[e], down[e]),
                       0, torch.zeros(x.shape), act, None if not act.bias else _Bias(bias))
    err_fused = float((_run_kernel(*case, act).double() - want).abs().max())
    err_torch = float((torch_path.double() - want).abs().max())
    assert err_fused < 1.5 * err_torch + 1e-3, (err_fused, err_torch)


class _Bias:
    def __init__(self, bias: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.bias = bias

    def of(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.bias[0][e], self.bias[1][e]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_output_does_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """Each output element sums in a fixed order, whatever the other rows: a token alone and
    within 24 tokens (several row tiles, other experts active) gives the same bits."""
    x, gate_up, down, bias, ids, weights = _case(24, 128, 64, 8, 2, dtype, seed=5)
    batch = _run_kernel(x, gate_up, down, bias, ids, weights, OAI)
    for t in (0, 7, 23):
        alone = _run_kernel(x[t : t + 1].clone(), gate_up, down, bias, ids[t : t + 1], weights[t : t + 1], OAI)
        assert torch.equal(alone[0], batch[t])


def test_bad_layout_is_refused() -> None:
    x, gate_up, down, _, ids, weights = _case(2, 64, 32, 4, 1, torch.float32)
    out = torch.zeros(x.shape)
    with pytest.raises(RuntimeError, match=r"down\[0\] must be a contiguous \[H, I\]"):
        kernel.fused_moe(x, [gate_up[0]], [down[0].t()], None, torch.tensor([0, 1]), torch.ones(2), [2], 0, 1.0,
                         0.0, out)
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        kernel.fused_moe(x.half(), [gate_up[0].half()], [down[0].half()], None, torch.tensor([0, 1]), torch.ones(2),
                         [2], 0, 1.0, 0.0, out)


# ---- in the engine ------------------------------------------------------------------


def _generate(llm: LLM, prompts: list[list[int]], n: int = 24) -> list[tuple[list[int], LogitsRecorder]]:
    recs = [LogitsRecorder() for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy_params(r, n) for r in recs])
    return [(o.outputs[0].token_ids, r) for o, r in zip(outs, recs)]


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = executor_module.fused_moe

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(executor_module, "fused_moe", counting)
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_equals_resident_bit_for_bit(gpt_oss_dir: str, kernel_calls: list[int], dtype: str) -> None:
    """gpt-oss (biases, swigluoai, fused x @ W experts): at a 25% budget the paged executor
    runs the kernel per wave of slots; tokens and logits equal the resident engine's."""
    prompts = parity_prompts()[:6]
    kw = dict(dtype=dtype, max_model_len=96, block_size=4, moe_runner_backend="fused_cpu")
    resident = _generate(LLM(gpt_oss_dir, **kw), prompts)
    used = kernel_calls[0]
    paged = _generate(LLM(gpt_oss_dir, expert_budget=0.25, **kw), prompts)
    assert used > 0 and kernel_calls[0] > used
    for (t1, r1), (t2, r2) in zip(resident, paged):
        assert t1 == t2
        assert all(torch.equal(a, b) for a, b in zip(r1.logits, r2.logits))


@pytest.mark.parametrize("backend", ["torch", "fused_cpu"])
def test_hf_parity_with_either_backend(qwen3_moe_dir: str, backend: str, kernel_calls: list[int]) -> None:
    prompts = parity_prompts()
    llm = LLM(qwen3_moe_dir, dtype="float32", max_model_len=128, moe_runner_backend=backend)
    report = check_all(prompts, _generate(llm, prompts, NUM_NEW_TOKENS), HFReference(qwen3_moe_dir), backend)
    assert report.max_logit_diff < 1e-4
    assert (kernel_calls[0] > 0) == (backend == "fused_cpu")


def test_backend_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    assert use_fused_moe("auto", cpu, f32, False) and use_fused_moe("auto", cpu, torch.bfloat16, False)
    assert not use_fused_moe("torch", cpu, f32, False)
    assert not use_fused_moe("auto", cpu, torch.float16, False)
    assert not use_fused_moe("auto", cpu, f32, True)  # batch-invariant mode keeps the PyTorch path
    with pytest.raises(ValueError, match="not batch-invariant"):
        use_fused_moe("fused_cpu", cpu, f32, True)
    with pytest.raises(ValueError, match="runs on CPU in float32 or bfloat16"):
        use_fused_moe("fused_cpu", torch.device("meta"), f32, False)
    with pytest.raises(ValueError, match="unknown moe_runner_backend 'triton'"):
        EngineConfig(model="any", moe_runner_backend="triton")
    monkeypatch.setattr(builder, "load_fused_moe", lambda: False)  # as without a compiler
    assert not use_fused_moe("auto", cpu, f32, False)
    with pytest.raises(ValueError, match=r"install a C\+\+ compiler"):
        use_fused_moe("fused_cpu", cpu, f32, False)


def test_no_compiler_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kernel.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="moestream.kernels.fused_moe"):
        assert kernel.load_fused_moe.__wrapped__() is False
    assert "no C++ compiler" in caplog.text and "PyTorch MoE path" in caplog.text


def test_fused_applies_by_mean_rows_per_active_expert() -> None:
    """The rule both executors apply to a layer's counts (pairs per expert, all experts)."""
    bf16, f32 = torch.empty(1, 4, dtype=torch.bfloat16), torch.empty(1, 4)
    assert fused_applies(True, 0, bf16, [12, 0, 12, 0])  # mean 12 over the two active experts
    assert not fused_applies(True, 0, bf16, [13, 0, 12, 0])
    assert fused_applies(True, 0, f32, [40, 24, 0, 0]) and not fused_applies(True, 0, f32, [40, 25, 0, 0])
    assert not fused_applies(False, 0, f32, [1, 0, 0, 0])  # off
    assert not fused_applies(True, 4, f32, [1, 0, 0, 0])  # batch-invariant mode
    assert not fused_applies(True, 0, bf16.half(), [1, 0, 0, 0])  # float16: no kernel
