"""moestream's CPU kernels (moestream/kernels/): the fused MoE layer and paged decode
attention against float64 oracles written from their definitions, outputs independent of the
rows around them, greedy argmax against torch's, the engine's use of them (resident and
paged agree bit for bit, HF parity with the PyTorch paths as well), and the fallback when
they cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_NEW_TOKENS, HFReference, count_calls, parity_prompts
from parity import LogitsRecorder, check_all, greedy_params

import moestream.layers.attention_backend as attention_module
import moestream.layers.expert_executor as executor_module
import moestream.layers.linear as linear_module
import moestream.layers.norm as norm_module
import moestream.layers.rotary as rotary_module
from moestream import LLM
from moestream.config import EngineConfig, ExpertActivation
from moestream.engine import builder
from moestream.engine.builder import use_cpu_kernel
from moestream.engine.model_runner import LOGITS_BUFFER_MAX_BYTES
from moestream.experts.interface import ExpertWeights
from moestream.kernels import build
from moestream.kernels import fused_moe as kernel
from moestream.kernels.linear import blocked_step, has_amx
from moestream.kernels.paged_attention import paged_decode_attention
from moestream.kernels.sampling import argmax_rows
from moestream.sampler import Sampler
from moestream.sampling_params import SamplingParams
from moestream.experts.resident import ResidentExpertStore
from moestream.layers.expert_executor import ResidentExpertExecutor, _loop, fused_amx, fused_applies, sort_by_expert
from moestream.layers.router import TopKRouter

OAI = ExpertActivation("swigluoai", alpha=1.702, limit=7.0, bias=True)
# bf16 dot products through AVX-512 and, on CPUs with AMX-BF16, through AMX tiles
AMX = [False] + ([True] if has_amx() else [])


def _case(t: int, h: int, i: int, e: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    gate_up = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    down = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    bias = ((torch.randn(e, 2 * i, generator=g) * 0.1).to(dtype), (torch.randn(e, h, generator=g) * 0.1).to(dtype))
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, k] distinct per token
    weights = torch.rand(t, k, generator=g)
    return x, gate_up, down, bias, ids, weights


def _run_kernel(x, gate_up, down, bias, ids, weights, act: ExpertActivation, amx: bool | None = None) -> torch.Tensor:
    order, token_of, counts = sort_by_expert(ids, gate_up.shape[0])
    cl = counts.tolist()
    active = [e for e, c in enumerate(cl) if c]
    b = ([bias[0][e] for e in active], [bias[1][e] for e in active]) if act.bias else None
    out = torch.zeros(x.shape, dtype=torch.float32)
    return kernel.fused_moe(x, [gate_up[e] for e in active], [down[e] for e in active], b, token_of,
                            weights.flatten()[order].contiguous(), [cl[e] for e in active],
                            kernel.ACT_CODES[act.name], act.alpha, act.limit, out, amx=amx)


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


@pytest.mark.parametrize("amx", AMX, ids=lambda a: "amx" if a else "avx512")
@pytest.mark.parametrize("act", [ExpertActivation(), OAI], ids=["silu", "swigluoai"])
def test_bf16_as_close_to_the_oracle_as_the_torch_path(act: ExpertActivation, amx: bool) -> None:
    """bf16 rounds after each op as torch does, so its error is the PyTorch path's (H and I
    multiples of 32: AMX tiles where asked)."""
    err_fused, err_torch = _errors(_case(12, 128, 64, 8, 3, torch.bfloat16, seed=3), act, amx)
    assert err_fused < 1.5 * err_torch + 1e-3, (err_fused, err_torch)


def _errors(case: tuple, act: ExpertActivation, amx: bool | None = None) -> tuple[float, float]:
    """The fused kernel's and the PyTorch path's largest error from the float64 oracle."""
    x, gate_up, down, bias, ids, weights = case
    want = _oracle(*case, act)
    order, token_of, counts = sort_by_expert(ids, gate_up.shape[0])
    cl = counts.tolist()
    active = [e for e, c in enumerate(cl) if c]
    torch_path = _loop(x, token_of, weights.flatten()[order], cl, active, lambda e: ExpertWeights(gate_up[e], down[e]),
                       0, torch.zeros(x.shape), act, None if not act.bias else _Bias(bias))
    return (float((_run_kernel(*case, act, amx=amx).double() - want).abs().max()),
            float((torch_path.double() - want).abs().max()))


class _Bias:
    def __init__(self, bias: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.bias = bias

    def of(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.bias[0][e], self.bias[1][e]


def test_more_pairs_than_one_group_match_the_oracle() -> None:
    """Past ~512 pairs the kernel runs its experts in groups, one after another: 300 tokens x 2
    (600 pairs, several groups) still match the float64 oracle; in bf16 SwiGLU (AMX's
    two-pass path where the CPU has it) as close as the PyTorch path."""
    case = _case(300, 64, 32, 8, 2, torch.float32, seed=11)
    got, want = _run_kernel(*case, OAI), _oracle(*case, OAI)
    assert (got.double() - want).abs().max() < 2e-5 * max(1.0, float(want.abs().max()))
    err_fused, err_torch = _errors(_case(300, 64, 32, 8, 2, torch.bfloat16, seed=11), SILU_BIAS)
    assert err_fused < 1.5 * err_torch + 1e-3, (err_fused, err_torch)


SILU_BIAS = ExpertActivation(bias=True)


@pytest.mark.parametrize("act", [OAI, SILU_BIAS], ids=["swigluoai", "silu-bias"])
@pytest.mark.parametrize("dtype,amx", [(torch.float32, False)] + [(torch.bfloat16, a) for a in AMX],
                         ids=lambda v: {False: "avx512", True: "amx"}.get(v, str(v)))
def test_a_tokens_output_does_not_depend_on_the_batch(dtype: torch.dtype, amx: bool, act: ExpertActivation) -> None:
    """Each output element sums in a fixed order, whatever the other rows: a token alone and
    within 80 tokens (several row tiles, up to three 16-row AMX blocks per expert, other
    experts active) gives the same bits, on 1 thread or 2. bf16 SwiGLU on AMX: the batch (40
    rows an expert) takes the two-pass path (the activation in gate_up's epilogue, the combine
    in down's), a token alone the four passes, so this also holds the two to the same bits."""
    x, gate_up, down, bias, ids, weights = _case(80, 128, 64, 8, 4, dtype, seed=5)
    batch = _run_kernel(x, gate_up, down, bias, ids, weights, act, amx=amx)
    assert int(torch.bincount(ids.flatten()).max()) > 32
    for t in (0, 7, 23, 79):
        alone = _run_kernel(x[t : t + 1].clone(), gate_up, down, bias, ids[t : t + 1], weights[t : t + 1], act,
                            amx=amx)
        assert torch.equal(alone[0], batch[t])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_run_kernel(x, gate_up, down, bias, ids, weights, act, amx=amx), batch)
    finally:
        torch.set_num_threads(threads)


def test_kernels_run_on_torchs_threads() -> None:
    """Regression: built without OpenMP, at::parallel_for ran every kernel on one thread
    whatever torch's thread count (the fused MoE layer streamed 15 GB/s on 1 or 2 threads).
    Outputs stay bit-identical across thread counts: work items never split a dot product."""
    assert build.load_cpu_kernels()
    before = torch.get_num_threads()
    case = _case(16, 96, 40, 12, 4, torch.float32)
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.ops.moestream_cpu.parallel_threads() == n
            outs.append(_run_kernel(*case, ExpertActivation("silu")))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_bad_layout_is_refused() -> None:
    x, gate_up, down, _, ids, weights = _case(2, 64, 32, 4, 1, torch.float32)
    out = torch.zeros(x.shape)
    with pytest.raises(RuntimeError, match=r"down\[0\] must be a contiguous \[H, I\]"):
        kernel.fused_moe(x, [gate_up[0]], [down[0].t()], None, torch.tensor([0, 1]), torch.ones(2), [2], 0, 1.0,
                         0.0, out)
    with pytest.raises(RuntimeError, match=r"token_of\[1\] = 2 is not a row of x"):
        kernel.fused_moe(x, [gate_up[0]], [down[0]], None, torch.tensor([0, 2]), torch.ones(2), [2], 0, 1.0, 0.0, out)
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        kernel.fused_moe(x.half(), [gate_up[0].half()], [down[0].half()], None, torch.tensor([0, 1]), torch.ones(2),
                         [2], 0, 1.0, 0.0, out)


def _int_matrix(method, out: int, inp: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One compressed-tensors matrix's stored tensors: random integers of the method's bit
    width (packed as llm-compressor packs them), bf16 scales, zero points when asymmetric."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    c = method.config
    groups = -(-inp // c.group_size) if c.strategy == "group" else 1
    lo, hi = -(2 ** (c.bits - 1)), 2 ** (c.bits - 1)
    q = torch.randint(lo, hi, (out, inp), generator=g, dtype=torch.int8)
    parts = {".weight_scale": (torch.rand(out, groups, generator=g) * 0.02 + 0.001).to(torch.bfloat16)}
    if c.strategy == "tensor":
        parts[".weight_scale"] = parts[".weight_scale"][0, :1].reshape(1)
    if method.packed:
        parts[".weight_packed"] = pack_to_int32(q, c.bits)
    else:
        parts[".weight"] = q
    if not c.symmetric:
        zp = torch.randint(lo, hi, (out, groups), generator=g, dtype=torch.int8)
        parts[".weight_zero_point"] = pack_to_int32(zp, c.bits, packed_dim=0) if method.packed else zp
    return parts


INT_FORMATS = [  # (format, bits, strategy, group_size, symmetric, gate and up apart)
    ("pack-quantized", 4, "group", 16, True, True), ("pack-quantized", 4, "group", 24, False, False),
    ("pack-quantized", 4, "channel", 0, False, True), ("pack-quantized", 8, "group", 32, False, True),
    ("int-quantized", 8, "channel", 0, True, False), ("int-quantized", 8, "tensor", 0, True, True),
    ("naive-quantized", 8, "group", 16, False, True)]


@pytest.mark.parametrize("fmt", INT_FORMATS, ids=lambda f: "-".join(map(str, f)))
@pytest.mark.parametrize("dtype,h,i", [(torch.float32, 72, 40), (torch.bfloat16, 72, 40), (torch.bfloat16, 96, 64)])
def test_int_experts_equal_the_dequantized_bit_for_bit(fmt: tuple, dtype: torch.dtype, h: int, i: int) -> None:
    """fused_moe_int on compressed-tensors int4 / int8 experts (read in place) equals
    fused_moe on the same experts dequantized by `dequantize` (the PyTorch path's weights),
    bit for bit; H and I that are not multiples of the SIMD width or of the group, and bf16
    ones that are multiples of 32 (AMX tiles on CPUs that have them)."""
    from moestream.config.quantization import QuantizationConfig
    from moestream.quantization.registry import make_quant_method

    form, bits, strategy, group, symmetric, apart = fmt
    method = make_quant_method(QuantizationConfig("compressed-tensors", format=form, bits=bits, strategy=strategy,
                                                  group_size=group, symmetric=symmetric))
    t, e, k = 5, 6, 2
    x, _, _, _, ids, weights = _case(t, h, i, e, k, dtype, seed=3)
    g = torch.Generator().manual_seed(7)
    ints, gate_up, down = [], [], []
    for _ in range(e):
        blocks = [(_int_matrix(method, i, h, g), (i, h)), (_int_matrix(method, i, h, g), (i, h))] if apart else [
            (_int_matrix(method, 2 * i, h, g), (2 * i, h))]
        d = _int_matrix(method, h, i, g)
        ints.append(([method.int_weights(p, shape) for p, shape in blocks], method.int_weights(d, (h, i))))
        gate_up.append(torch.cat([method.dequantize(p, shape) for p, shape in blocks]).to(dtype))
        down.append(method.dequantize(d, (h, i)).to(dtype))
    order, token_of, counts = sort_by_expert(ids, e)
    cl = counts.tolist()
    active = [j for j, c in enumerate(cl) if c]
    args = (None, token_of, weights.flatten()[order].contiguous(), [cl[j] for j in active], 0, 1.0, 0.0)
    want = kernel.fused_moe(x, [gate_up[j] for j in active], [down[j] for j in active], *args,
                            torch.zeros(x.shape))
    got = kernel.fused_moe_int(x, [ints[j] for j in active], *args, torch.zeros(x.shape))
    assert want.abs().sum() > 0
    assert torch.equal(got, want)


def test_int_experts_bad_input_is_refused() -> None:
    from moestream.quantization.method import IntWeights

    x = torch.randn(2, 32)
    q = torch.zeros(64, 32, dtype=torch.int8)
    ok = IntWeights((64, 32), q, torch.ones(64, 1), None, 8, 0, 0)
    short = IntWeights((32, 32), torch.zeros(32, 8, dtype=torch.int8), torch.ones(32, 1), None, 8, 0, 0)
    with pytest.raises(RuntimeError, match=r"down q\[0\] must be an integer \[32, >= 32 bytes\]"):
        kernel.fused_moe_int(x, [([ok], short)], None, torch.tensor([0, 1]), torch.ones(2), [2], 0, 1.0, 0.0,
                             torch.zeros(2, 32))
    bad_scale = IntWeights((32, 32), torch.zeros(32, 32, dtype=torch.int8), torch.ones(32, 2), None, 8, 0, 0)
    with pytest.raises(RuntimeError, match=r"down scale\[0\] must be a contiguous float32 \[32, 1\]"):
        kernel.fused_moe_int(x, [([ok], bad_scale)], None, torch.tensor([0, 1]), torch.ones(2), [2], 0, 1.0, 0.0,
                             torch.zeros(2, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_linear_is_exact_and_batch_invariant(dtype: torch.dtype) -> None:
    """cpu_linear: within float32 rounding of the float64 product (bf16: within one bf16
    step of it), and each row's output the same whether computed alone or among 1-37 rows
    (N not a multiple of the column chunk, K not of the SIMD width)."""
    from moestream.kernels.linear import cpu_linear

    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 200, generator=g).to(dtype)
    w = (torch.randn(1000, 200, generator=g) / 200**0.5).to(dtype)
    got = cpu_linear(x, w)
    exact = x.double() @ w.double().T
    assert got.dtype == dtype and got.shape == (37, 1000)
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    assert ((got.double() - exact).abs() <= tol * exact.abs() + tol).all()
    for m in (1, 2, 3, 4, 5, 16):
        assert torch.equal(cpu_linear(x[:m].contiguous(), w), got[:m])
    assert torch.equal(cpu_linear(x[7:8].contiguous(), w), got[7:8])
    with pytest.raises(RuntimeError, match="weight must be a contiguous"):
        cpu_linear(x, w.t().contiguous().t())


def test_blocked_linear_equals_the_unblocked_bit_for_bit() -> None:
    """cpu_linear_blocked on pack_blocked's layout (float32): the same values as cpu_linear at
    any row count (N not a multiple of the 16-column block); builds without AVX-512, and bf16
    weights (which take the VNNI layout), are refused."""
    from moestream.kernels.linear import cpu_linear, cpu_linear_blocked, pack_blocked

    g = torch.Generator().manual_seed(8)
    dtype = torch.float32
    w = (torch.randn(1000, 128, generator=g) / 128**0.5).to(dtype)
    with pytest.raises(ValueError, match="no blocked layout"):
        pack_blocked(w.bfloat16())
    step = blocked_step(dtype)
    if step == 0:
        with pytest.raises(ValueError, match="no blocked layout"):
            pack_blocked(w)
        return
    packed = pack_blocked(w)
    assert packed.shape == (63, 128 // step, 16, step)
    for m in (1, 2, 3, 4, 5, 17, 70):
        x = torch.randn(m, 128, generator=g).to(dtype)
        assert torch.equal(cpu_linear_blocked(x, packed, 1000), cpu_linear(x, w))
    with pytest.raises(ValueError, match="no blocked layout"):
        pack_blocked(w[:, :100].contiguous())  # K not a multiple of the step
    with pytest.raises(RuntimeError, match="packed must be a contiguous"):
        cpu_linear_blocked(x, packed, 2000)


@pytest.mark.parametrize("amx", AMX, ids=lambda a: "amx" if a else "avx512")
def test_vnni_linear_is_close_and_batch_invariant(amx: bool) -> None:
    """cpu_linear_vnni on pack_vnni's layout (bf16), through AVX512_BF16 or AMX tiles: within
    one bf16 step of the float64 product, a row the same alone or among 300 (N not a multiple
    of the 128-output block nor of AMX's 32-output pass; more than one 32-row AMX pass and
    256-row work item); builds without AVX512_BF16 refuse to pack."""
    from moestream.kernels.linear import cpu_linear_vnni, has_vnni_bf16, pack_vnni

    g = torch.Generator().manual_seed(9)
    w = (torch.randn(1000, 128, generator=g) / 128**0.5).bfloat16()
    if not has_vnni_bf16():
        with pytest.raises(ValueError, match="no VNNI layout"):
            pack_vnni(w)
        return
    packed = pack_vnni(w)
    assert packed.shape == (8, 64, 8, 16, 2)
    x = torch.randn(300, 128, generator=g).bfloat16()
    got = cpu_linear_vnni(x, packed, 1000, amx=amx)
    exact = x.double() @ w.double().T
    assert got.dtype == torch.bfloat16 and ((got.double() - exact).abs() <= 2.0**-7 * exact.abs() + 1e-3).all()
    for m in (1, 2, 3, 4, 5, 17):
        assert torch.equal(cpu_linear_vnni(x[:m].contiguous(), packed, 1000, amx=amx), got[:m])
    assert torch.equal(cpu_linear_vnni(x[40:41].contiguous(), packed, 1000, amx=amx), got[40:41])
    assert torch.equal(cpu_linear_vnni(x[66:67].contiguous(), packed, 1000, amx=amx), got[66:67])
    assert torch.equal(cpu_linear_vnni(x[270:299].contiguous(), packed, 1000, amx=amx), got[270:299])
    bias = torch.randn(1000, generator=g).bfloat16()
    biased = cpu_linear_vnni(x, packed, 1000, bias, amx=amx)  # the bias added in float32 before the rounding
    exact_b = exact + bias.double()
    assert ((biased.double() - exact_b).abs() <= 2.0**-7 * exact_b.abs() + 1e-3).all()
    assert not torch.equal(biased, got)
    wide = cpu_linear_vnni(x, packed, 1000, bias, amx=amx, out_dtype=torch.float32)  # the logits' one-pass float32
    assert wide.dtype == torch.float32 and torch.equal(wide, biased.float())
    # the float32 output is rounded as the bf16 one (round16 against to_bf16_bits), bit for bit, on
    # a NaN, overflow to infinity, sums near float32's smallest normals, and exact ties
    special = x[:4].clone()
    special[0, 0] = float("nan")
    special[1] *= 1e-37
    special[2] = 3e38  # sums past float32's largest: infinities
    special[3] = 0
    special[3, 0] = 1.0078125  # 1 + 2^-7: its products with bf16 weights have 16 bits, some a tie at bf16
    narrow = cpu_linear_vnni(special, packed, 1000, amx=amx)
    wide = cpu_linear_vnni(special, packed, 1000, amx=amx, out_dtype=torch.float32)
    assert narrow[0].isnan().any() and narrow[2].isinf().any()
    assert torch.equal(wide.view(torch.int32), narrow.float().view(torch.int32))
    with pytest.raises(RuntimeError, match=r"bias must be a float \[1000\]"):
        cpu_linear_vnni(x, packed, 1000, bias[:10])
    with pytest.raises(ValueError, match="no VNNI layout"):
        pack_vnni(w[:, :127].contiguous())  # K odd
    with pytest.raises(RuntimeError, match="packed must be a contiguous bfloat16"):
        cpu_linear_vnni(x, packed, 2000)
    odd = pack_vnni(w[:, :80].contiguous())  # K not a multiple of AMX's 32
    x80 = x[:3, :80].contiguous()
    assert torch.equal(cpu_linear_vnni(x80, odd, 1000), cpu_linear_vnni(x80, odd, 1000, amx=False))
    with pytest.raises(RuntimeError, match="AMX needs AMX-BF16 and K a multiple of 32"):
        cpu_linear_vnni(x80, odd, 1000, amx=True)


def test_bf16_engine_lm_head_takes_the_vnni_kernel(qwen3_moe_dir: str) -> None:
    """A bf16 engine lays its lm_head and routers out for the VNNI kernel (where the build has
    it) and its logits stay within bf16 rounding of the PyTorch paths' (oneDNN)."""
    from moestream.kernels.linear import has_vnni_bf16

    prompts = parity_prompts()[:3]
    kernels = LLM(qwen3_moe_dir, dtype="bfloat16", max_model_len=96)
    model = kernels.llm_engine.runner.model
    assert model.lm_head.blocked_out == (151936 if has_vnni_bf16() else 0)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert routers and all((r.vnni is not None) == has_vnni_bf16() for r in routers)
    x = torch.randn(5, routers[0].weight.shape[1]).bfloat16()
    want = F.linear(x, routers[0].weight).float()
    assert (routers[0].logits(x) - want).abs().max() <= 2.0**-7 * want.abs().max() + 1e-3
    torch_paths = LLM(qwen3_moe_dir, dtype="bfloat16", max_model_len=96, gemm_backend="torch")
    assert torch_paths.llm_engine.runner.model.lm_head.blocked_out == 0
    assert all(m.vnni is None for m in torch_paths.llm_engine.runner.model.modules() if isinstance(m, TopKRouter))
    for (_, r1), (_, r2) in zip(_generate(kernels, prompts, 1), _generate(torch_paths, prompts, 1)):
        assert (r1.logits[0] - r2.logits[0]).abs().max() < 0.1
    # the sampled rows' logits go into a buffer the runner keeps across steps (regression: a new
    # [64, V] float32 tensor a step was ~7 ms of page faults), written in one pass as float32
    runner = kernels.llm_engine.runner
    two = runner._logits_out(2)
    assert two.shape == (2, 151936) and runner._logits_out(2).data_ptr() == two.data_ptr()
    assert runner._logits_out(LOGITS_BUFFER_MAX_BYTES // (4 * 151936) + 1) is None  # past the cap: a new tensor
    h = torch.randn(2, model.config.hidden_size).bfloat16()
    assert torch.equal(model.compute_logits(h, two), model.lm_head(h).float())


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel(dtype: torch.dtype, unit_offset: bool) -> None:
    """cpu_rms_norm / cpu_add_rms_norm: float32 within rounding of the float64 norm, bf16 at
    most one bf16 step from the PyTorch path (the sum of squares' order differs), a row the
    same alone or among 37 (D not a multiple of the 16 lanes), the residual sum equal to
    torch's add bit for bit."""
    from moestream.kernels.norm import cpu_add_rms_norm, cpu_rms_norm
    from moestream.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 200, generator=g) * 4).to(dtype)
    res = torch.randn(37, 200, generator=g).to(dtype)
    norm = RMSNorm(200, 1e-6, unit_offset).to(dtype)
    norm.weight.data = (torch.randn(200, generator=g) * 0.2 + (0 if unit_offset else 1)).to(dtype)
    got = cpu_rms_norm(x, norm.weight, 1e-6, unit_offset)
    x64, w64 = x.double(), norm.weight.double()
    exact = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * ((1 + w64) if unit_offset else w64)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 4e-6 if dtype == torch.float32 else 2.0**-7
    assert ((got.double() - exact).abs() <= tol * exact.abs() + tol).all()
    torch_path = norm(x)  # cpu_kernel off: the eight PyTorch operators
    assert ((got.float() - torch_path.float()).abs() <= 2.0**-7 * torch_path.float().abs() + 1e-6).all()
    for r in (0, 5, 36):
        assert torch.equal(cpu_rms_norm(x[r : r + 1], norm.weight, 1e-6, unit_offset), got[r : r + 1])
    h, y = cpu_add_rms_norm(x, res, norm.weight, 1e-6, unit_offset)
    assert torch.equal(h, res + x) and torch.equal(y, cpu_rms_norm(res + x, norm.weight, 1e-6, unit_offset))
    heads = x.view(37, 8, 25)  # q/k norm: [T, H, D] over the last dim
    assert torch.equal(cpu_rms_norm(heads, norm.weight[:25].contiguous(), 1e-6, unit_offset)[3],
                       cpu_rms_norm(heads[3].contiguous(), norm.weight[:25].contiguous(), 1e-6, unit_offset))
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous \[200\] in x's dtype"):
        cpu_rms_norm(x, norm.weight[:100], 1e-6, unit_offset)
    with pytest.raises(RuntimeError, match="residual must be contiguous, of x's shape and dtype"):
        cpu_add_rms_norm(x, res[:3], norm.weight, 1e-6, unit_offset)


def test_rms_norm_module_takes_the_kernel_only_where_it_can() -> None:
    """RMSNorm with cpu_kernel: a non-contiguous input or another dtype keeps the PyTorch path
    (the same values as with the kernel off)."""
    from moestream.layers.norm import RMSNorm

    norm = RMSNorm(16, 1e-5)
    norm.weight.data = torch.linspace(0.5, 1.5, 16)
    x = torch.randn(4, 32)[:, ::2]  # strided
    off, off64 = norm(x), norm(x.double())
    norm.cpu_kernel = True
    assert torch.equal(norm(x), off)
    assert torch.equal(norm(x.double()), off64)  # the kernel would refuse float64
    h, y = norm.forward_add(x, torch.ones(4, 16))
    assert torch.equal(h, x + 1) and torch.allclose(y, norm(x + 1), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("interleaved", "partial", "mrope"), [(False, 1.0, False), (False, 0.5, False),
                                                               (False, 1.0, True), (True, 1.0, False),
                                                               (True, 0.5, False)])
def test_rotary_kernel_equals_the_torch_path(dtype: torch.dtype, interleaved: bool, partial: float,
                                             mrope: bool) -> None:
    """The C++ rotary embedding rotates q and k in place to exactly the PyTorch path's values:
    rotate-half and interleaved pairs, partial rotary, M-RoPE positions, strided heads (a
    gated q_proj's query half)."""
    from moestream.config import RopeConfig
    from moestream.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(RopeConfig("default", 10000.0), 64, 4096, torch.device("cpu"), partial,
                          (8, 12, 12) if mrope else None, interleaved)
    g = torch.Generator().manual_seed(1)
    pos = torch.randint(0, 4000, (3, 7) if mrope else (7,), generator=g)
    q = torch.randn(7, 8, 128, generator=g).to(dtype)[:, :, :64]
    k = torch.randn(7, 2, 64, generator=g).to(dtype)
    want_q, want_k = rot(pos, q.clone(), k.clone())
    rot.cpu_kernel = True
    got_q, got_k = rot(pos, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    rot.cpu_kernel = False
    other = pos + 1  # new positions: new tables, not the cached ones
    assert not torch.equal(rot(other, q.clone(), k.clone())[1], rot(pos, q.clone(), k.clone())[1])


def test_rotary_kernel_refuses_bad_tables() -> None:
    from moestream.kernels.rotary import cpu_apply_rotary

    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        cpu_apply_rotary(q, k, torch.randn(3, 8).bfloat16(), torch.randn(3, 8).bfloat16(), False)
    with pytest.raises(RuntimeError, match="q has 3 tokens, cos 2"):
        cpu_apply_rotary(q, k, torch.randn(2, 8), torch.randn(2, 8), False)
    with pytest.raises(RuntimeError, match="rotary dim 16 must be even and at most q's head dim 8"):
        cpu_apply_rotary(q, k, torch.randn(3, 16), torch.randn(3, 16), False)


# ---- in the engine ------------------------------------------------------------------


def _generate(llm: LLM, prompts: list[list[int]], n: int = 24) -> list[tuple[list[int], LogitsRecorder]]:
    recs = [LogitsRecorder() for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy_params(r, n) for r in recs])
    return [(o.outputs[0].token_ids, r) for o, r in zip(outs, recs)]


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return count_calls(monkeypatch, executor_module, "fused_moe")


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


@pytest.mark.parametrize(("moe", "attention", "gemm"), [("torch", "torch_sdpa", "torch"),
                                                        ("fused_cpu", "cpu_paged", "cpu")])
def test_hf_parity_with_either_backend(qwen3_moe_dir: str, moe: str, attention: str, gemm: str,
                                       kernel_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    attention_calls = count_calls(monkeypatch, attention_module, "paged_decode_attention")
    gemm_calls = count_calls(monkeypatch, linear_module, "cpu_linear")
    norm_calls = count_calls(monkeypatch, norm_module, "cpu_add_rms_norm")
    rotary_calls = count_calls(monkeypatch, rotary_module, "cpu_apply_rotary")
    prompts = parity_prompts()
    llm = LLM(qwen3_moe_dir, dtype="float32", max_model_len=128, moe_runner_backend=moe, attention_backend=attention,
              gemm_backend=gemm)
    report = check_all(prompts, _generate(llm, prompts, NUM_NEW_TOKENS), HFReference(qwen3_moe_dir), moe)
    assert report.max_logit_diff < 1e-4
    assert (kernel_calls[0] > 0) == (moe == "fused_cpu")
    assert (attention_calls[0] > 0) == (attention == "cpu_paged")
    assert (gemm_calls[0] > 0) == (gemm == "cpu")
    assert (norm_calls[0] > 0) == (gemm == "cpu") and (rotary_calls[0] > 0) == (gemm == "cpu")
    lm_head = llm.llm_engine.runner.model.lm_head  # float32: blocked for the CPU GEMM where the build has it
    blocked = gemm == "cpu" and blocked_step(torch.float32) > 0
    assert lm_head.blocked_out == (151936 if blocked else 0) and lm_head.weight.dim() == (4 if blocked else 2)


def test_backend_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, f32 = torch.device("cpu"), torch.float32

    def use_fused_moe(choice: str, device: torch.device, dtype: torch.dtype, batch_invariant: bool) -> bool:
        return use_cpu_kernel(choice, "moe_runner_backend", "fused_cpu", device, dtype, batch_invariant)

    assert use_fused_moe("auto", cpu, f32, False) and use_fused_moe("auto", cpu, torch.bfloat16, False)
    assert not use_fused_moe("torch", cpu, f32, False)
    assert not use_fused_moe("auto", cpu, torch.float16, False)
    assert not use_fused_moe("auto", cpu, f32, True)  # batch-invariant mode keeps the PyTorch path
    with pytest.raises(ValueError, match="moe_runner_backend fused_cpu is not batch-invariant"):
        use_fused_moe("fused_cpu", cpu, f32, True)
    with pytest.raises(ValueError, match="runs on CPU in float32 or bfloat16"):
        use_fused_moe("fused_cpu", torch.device("meta"), f32, False)
    assert use_cpu_kernel("auto", "attention_backend", "cpu_paged", cpu, f32, False)
    assert use_cpu_kernel("auto", "gemm_backend", "cpu", cpu, f32, False)
    with pytest.raises(ValueError, match="gemm_backend cpu is not batch-invariant"):
        use_cpu_kernel("cpu", "gemm_backend", "cpu", cpu, f32, True)
    assert not use_cpu_kernel("torch_sdpa", "attention_backend", "cpu_paged", cpu, f32, False)
    with pytest.raises(ValueError, match="unknown moe_runner_backend 'triton'"):
        EngineConfig(model="any", moe_runner_backend="triton")
    with pytest.raises(ValueError, match="unknown attention_backend 'flash'"):
        EngineConfig(model="any", attention_backend="flash")
    monkeypatch.setattr(builder, "load_cpu_kernels", lambda: False)  # as without a compiler
    assert not use_fused_moe("auto", cpu, f32, False)
    with pytest.raises(ValueError, match=r"install a C\+\+ compiler"):
        use_fused_moe("fused_cpu", cpu, f32, False)


def test_no_compiler_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="moestream.kernels.build"):
        assert build.load_cpu_kernels.__wrapped__() is False
    assert "no C++ compiler" in caplog.text and "using the PyTorch paths" in caplog.text


def test_fused_applies_by_mean_rows_per_active_expert() -> None:
    """The rule both executors apply to a layer's counts (pairs per expert, all experts)."""
    bf16, f32 = torch.empty(1, 4, dtype=torch.bfloat16), torch.empty(1, 4)
    assert fused_applies(True, 0, bf16, [12, 0, 12, 0])  # mean 12 over the two active experts
    assert not fused_applies(True, 0, bf16, [13, 0, 12, 0])
    wide = torch.empty(1, 64, dtype=torch.bfloat16)  # H a multiple of 32: AMX tiles where the CPU has them
    rows = 256 if has_amx() else 12
    assert fused_applies(True, 0, wide, [rows, 0, rows, 0]) and not fused_applies(True, 0, wide, [rows + 1, 0, rows, 0])
    assert fused_applies(True, 0, f32, [200, 56, 0, 0]) and not fused_applies(True, 0, f32, [200, 57, 0, 0])
    assert not fused_applies(False, 0, f32, [1, 0, 0, 0])  # off
    assert not fused_applies(True, 4, f32, [1, 0, 0, 0])  # batch-invariant mode
    assert not fused_applies(True, 0, bf16.half(), [1, 0, 0, 0])  # float16: no kernel
    # regression: an empty batch (no pairs) passed the mean test and the resident executor
    # then indexed an empty expert list
    assert not fused_applies(True, 0, torch.empty(0, 4), [0, 0, 0, 0])


def test_fused_amx_by_mean_rows_per_active_expert() -> None:
    """AMX tiles for bf16 only past 2 pairs per active expert on average (fewer stream the
    weights faster through the dot products), float32 never; the paged executor decides once
    per layer call (its waves then agree with the resident executor: test_paged_equals_resident)."""
    bf16, f32 = torch.empty(1, 64, dtype=torch.bfloat16), torch.empty(1, 64)
    assert not fused_amx(bf16, [2, 0, 2, 2])  # mean 2
    assert fused_amx(bf16, [3, 0, 2, 2]) == has_amx()  # mean 7/3
    assert fused_amx(bf16, [40, 0, 0, 0]) == has_amx()
    assert not fused_amx(f32, [40, 0, 0, 0])


def test_resident_executor_on_an_empty_batch() -> None:
    store = ResidentExpertStore()
    store.set_layer(0, torch.randn(4, 16, 8), torch.randn(4, 8, 8))
    ex = ResidentExpertExecutor(store, 0, 4)
    ex.fused = True
    out = ex.forward(torch.empty(0, 8), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long))
    assert out.shape == (0, 8)


def test_swigluoai_passes_a_nan_through_as_torch() -> None:
    """torch.clamp keeps a NaN; the kernel's clamps must too (std::fmin would give the limit)."""
    x, gate_up, down, bias, _, weights = _case(2, 64, 32, 4, 1, torch.float32)
    ids = torch.tensor([[0], [1]])
    gate_up = gate_up.clone()
    gate_up[0, 0] = float("nan")  # expert 0 (token 0's): its first gate output is NaN
    out = _run_kernel(x, gate_up, down, bias, ids, weights, OAI)
    assert out[0].isnan().all() and not out[1].isnan().any()


# ---- paged decode attention --------------------------------------------------------------


def _paged_case(dtype: torch.dtype, lens: list[int], bs: int = 4, hq: int = 8, hk: int = 2, d: int = 40,
                strided: bool = False, seed: int = 0):
    """Random caches of 64 blocks and block tables of distinct shuffled blocks per request."""
    g = torch.Generator().manual_seed(seed)
    n_blocks, width = 64, max((n + bs - 1) // bs for n in lens)
    shape = (n_blocks, bs, hk, d)
    if strided:  # a view into a bigger pool, as elastic memory's (the last dim contiguous)
        k = torch.randn(n_blocks, bs, hk, 2 * d, generator=g).to(dtype)[..., :d]
        v = torch.randn(n_blocks, bs, hk, 2 * d, generator=g).to(dtype)[..., d:]
    else:
        k, v = torch.randn(*shape, generator=g).to(dtype), torch.randn(*shape, generator=g).to(dtype)
    perm = torch.randperm(n_blocks, generator=g)
    tables = perm[: len(lens) * width].view(len(lens), width).to(torch.int32)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    return q, k, v, tables, torch.tensor(lens)


def _reference(q, k, v, tables, lens, starts, scale) -> torch.Tensor:
    """float64 softmax attention per request on its gathered keys (GQA: heads repeated)."""
    out = []
    group = q.shape[1] // k.shape[2]
    for r in range(q.shape[0]):
        keys = k[tables[r].long()].flatten(0, 1)[int(starts[r]) : int(lens[r])].double()  # [S, Hk, D]
        vals = v[tables[r].long()].flatten(0, 1)[int(starts[r]) : int(lens[r])].double()
        keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)  # [S, Hq, D]
        w = torch.softmax(torch.einsum("hd,shd->hs", q[r].double(), keys) * scale, -1)
        out.append(torch.einsum("hs,shd->hd", w, vals))
    return torch.stack(out)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_float32_matches_the_reference(strided: bool, window: int | None) -> None:
    q, k, v, tables, lens = _paged_case(torch.float32, [1, 7, 16, 29], strided=strided)
    starts = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)
    got = paged_decode_attention(q, k, v, tables, lens, starts, 0.125)
    want = _reference(q, k, v, tables, lens, starts, 0.125)
    assert (got.double() - want).abs().max() < 1e-5


def test_paged_attention_bf16_and_batch_independence() -> None:
    q, k, v, tables, lens = _paged_case(torch.bfloat16, [3, 12, 30], hq=4, hk=4, d=64, seed=2)
    starts = torch.zeros_like(lens)
    batch = paged_decode_attention(q, k, v, tables, lens, starts, 0.125)
    want = _reference(q, k, v, tables, lens, starts, 0.125)
    assert (batch.double() - want).abs().max() < 2e-2  # bf16 output rounding
    for r in range(3):  # a request alone gives the same bits as in the batch
        alone = paged_decode_attention(q[r : r + 1].clone(), k, v, tables[r : r + 1].clone(), lens[r : r + 1].clone(),
                                       starts[r : r + 1].clone(), 0.125)
        assert torch.equal(alone[0], batch[r])


def test_paged_attention_refuses_bad_tables() -> None:
    q, k, v, tables, lens = _paged_case(torch.float32, [8])
    with pytest.raises(RuntimeError, match="a context of 9 tokens exceeds its block table"):
        paged_decode_attention(q, k, v, tables, lens + 1, torch.zeros_like(lens), 0.125)
    bad = tables.clone()
    bad[0, 1] = -1  # a freed (null) block inside the visible range
    with pytest.raises(RuntimeError, match=r"request 0 sees no key \(start 8, context 8\)"):
        paged_decode_attention(q, k, v, tables, lens, lens.clone(), 0.125)
    with pytest.raises(RuntimeError, match="request 0 reads block -1 of a cache of 64"):
        paged_decode_attention(q, k, v, bad, lens, torch.zeros_like(lens), 0.125)
    behind = tables.clone()
    behind[0, 0] = -1  # block 0 holds positions 0-3, behind a window that starts at 4: never read
    assert torch.equal(paged_decode_attention(q, k, v, behind, lens, torch.full_like(lens, 4), 0.125),
                       paged_decode_attention(q, k, v, tables, lens, torch.full_like(lens, 4), 0.125))


# ---- greedy argmax ---------------------------------------------------------------------------


def test_argmax_rows_equals_torch() -> None:
    """Random rows, ties (the first maximum wins), a NaN (torch's answer: its index), all
    -inf, and widths with and without a SIMD tail."""
    g = torch.Generator().manual_seed(0)
    for width in (151936, 17, 1):
        x = torch.randn(6, width, generator=g)
        x[1, -1] = x[1].max() + 1  # the maximum in the tail
        x[2, :] = 0.5  # all tied: index 0
        if width > 5:
            x[3, 3] = float("nan")
            x[5, width // 2] = x[5, width - 2] = x[5].max() + 1  # a tie: the first
        x[4, :] = float("-inf")
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), width


def test_sampler_greedy_tokens_equal_with_the_kernel() -> None:
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0)] * 5
    args = ([[1]] * 5, [[]] * 5, [None] * 5)
    with_kernel = Sampler(argmax_kernel=True)(logits, params, *args).token_ids
    assert with_kernel == Sampler()(logits, params, *args).token_ids
    assert with_kernel == logits.argmax(-1).tolist()
