"""`moestream.layers.linear.linear`: F.linear, computed in float32 for bf16/fp16 calls of many
rows on CPUs without native bf16 matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moestream.layers.linear import (
    ONEDNN_ROW_BUCKET,
    UPCAST_MIN_ROWS,
    CPU_GEMM_MAX_ROWS,
    CPU_GEMM_WIDE,
    Linear,
    bucket_rows,
    buckets_rows,
    cpu_has_native_bf16,
    linear,
    onednn_packing_available,
    pack_weight,
    prepacks,
    set_cpu_gemm,
    process_weights_after_loading,
)


@pytest.mark.parametrize("rows", [1, UPCAST_MIN_ROWS - 1, UPCAST_MIN_ROWS, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_low_precision_matches_float32_reference(rows: int, dtype: torch.dtype, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = (torch.randn(80, 96, generator=g) / 10).to(dtype)
    b = torch.randn(80, generator=g).to(dtype) if with_bias else None
    out = linear(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())  # [rows, 80] float32
    assert out.dtype == dtype and out.shape == (rows, 80)
    # one rounding of a float32 result: within half a unit in the last place of the dtype,
    # plus float32 summation-order noise.
    eps = torch.finfo(dtype).eps
    assert torch.all((out.float() - ref).abs() <= ref.abs() * eps + 1e-3), (out.float() - ref).abs().max()


def test_upcast_path_taken_only_where_it_pays() -> None:
    """Without native bf16, calls of >= UPCAST_MIN_ROWS rows (counted over all leading dims)
    equal the float32 GEMM rounded once; smaller calls and float32 calls are plain F.linear."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 256, generator=g).bfloat16()
    big = torch.randn(3, 4, 256, generator=g).bfloat16()  # 12 rows
    small = torch.randn(UPCAST_MIN_ROWS - 1, 256, generator=g).bfloat16()
    upcast_big = F.linear(big.float(), w.float()).bfloat16()
    assert torch.equal(linear(small, w), F.linear(small, w))
    assert torch.equal(linear(big.float(), w.float()), F.linear(big.float(), w.float()))
    if cpu_has_native_bf16():
        assert torch.equal(linear(big, w), F.linear(big, w))
    else:
        assert torch.equal(linear(big, w), upcast_big)


@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_bf16_weight_matches_linear_bitwise(with_bias: bool) -> None:
    """`Linear.process_weights_after_loading` packs a bf16 weight for oneDNN only where that
    CPU has native bf16 matmul, and the packed module's output is bitwise F.linear's for
    decode- and prefill-sized calls, 3-d inputs and the batch-invariant tiles. Elsewhere, and
    for float32, the weight stays as loaded."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(160, 96, generator=g) / 10).bfloat16()
    b = torch.randn(160, generator=g).bfloat16() if with_bias else None
    layer = Linear(96, 160, bias=with_bias)
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    if with_bias:
        layer.bias = torch.nn.Parameter(b.clone(), requires_grad=False)
    packed = layer.process_weights_after_loading()
    assert packed == prepacks(w)
    assert packed == (cpu_has_native_bf16() and onednn_packing_available())
    assert layer.weight.is_mkldnn == packed and layer.packed == packed
    assert layer.process_weights_after_loading() is False  # packing is done once
    for shape in [(1, 96), (7, 96), (16, 96), (64, 96), (3, 5, 96), (0, 96)]:
        x = torch.randn(*shape, generator=g).bfloat16()
        assert torch.equal(layer(x), linear(x, w, b)), shape
    x = torch.randn(13, 96, generator=g).bfloat16()
    layer.row_tile = 8
    assert torch.equal(layer(x), linear(x, w, b, row_tile=8))
    assert torch.equal(layer(x)[3], linear(x[3:4], w, b, row_tile=8)[0])  # a row alone, in the same tile shape
    f32 = Linear(96, 160)
    f32.weight = torch.nn.Parameter(w.float(), requires_grad=False)
    assert not f32.process_weights_after_loading() and not f32.weight.is_mkldnn


def test_process_weights_after_loading_counts_and_skips_unpackable() -> None:
    """The model-wide pass packs every packable bf16 `Linear` (where the CPU allows) and leaves
    modules marked `packable = False` (weights read directly, e.g. MLA's kv_b_proj) alone."""
    model = torch.nn.Sequential(Linear(32, 48), Linear(48, 32), Linear(32, 16))
    for m in model:
        m.weight = torch.nn.Parameter(torch.randn(m.weight.shape).bfloat16(), requires_grad=False)
    model[2].packable = False
    expected = 2 if prepacks(model[0].weight) else 0
    assert process_weights_after_loading(model) == expected
    assert not model[2].weight.is_mkldnn and model[0].packed == (expected == 2)


def test_bucket_rows_values() -> None:
    assert [bucket_rows(m) for m in (0, 1, 31, 32, 33, 64, 65, 100)] == [0, 1, 31, 32, 64, 64, 96, 128]
    assert [bucket_rows(m, CPU_GEMM_WIDE) for m in (1, 3, 4, 5, 33)] == [4, 4, 4, 5, 64]  # the lm_head


@pytest.mark.parametrize("packed", [False, True])
def test_wide_bf16_calls_of_few_rows_pad_to_four(packed: bool) -> None:
    """A bf16 call of 1-3 rows on a weight of CPU_GEMM_WIDE outputs (an lm_head) runs padded to
    4 rows where oneDNN takes bf16 calls; each row equals its own 1-row result either way."""
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(CPU_GEMM_WIDE, 64, generator=g) / 8).bfloat16()
    weight = pack_weight(w) if packed and prepacks(w) else w
    x = torch.randn(3, 64, generator=g).bfloat16()
    out = linear(x, weight, packed=weight is not w)
    want = F.linear(torch.cat([x, x.new_zeros(1, 64)]), w)[:3] if buckets_rows(x, w) else linear(x, w)
    assert torch.equal(out, want)
    assert torch.equal(linear(x[1:2], weight, packed=weight is not w), out[1:2])


@pytest.mark.parametrize("packed", [False, True])
def test_onednn_bf16_calls_run_padded_to_row_buckets(packed: bool) -> None:
    """Where bf16 calls go to oneDNN (native bf16 CPUs), a call of m > ONEDNN_ROW_BUCKET rows
    computes exactly as the call zero-padded to `bucket_rows(m)` rows, so calls whose row
    counts share a bucket give a row the same bits. Elsewhere bf16 calls are not padded."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(64, 48, generator=g) / 7).bfloat16()
    weight = pack_weight(w) if packed and prepacks(w) else w
    is_packed = weight is not w
    x = torch.randn(50, 48, generator=g).bfloat16()
    padded = torch.cat([x, x.new_zeros(bucket_rows(50) - 50, 48)])  # [64, 48]
    assert buckets_rows(x, w) == cpu_has_native_bf16()
    out = linear(x, weight, packed=is_packed)
    if buckets_rows(x, w):
        assert torch.equal(out, F.linear(padded, w)[:50])
        assert torch.equal(linear(x[:40], weight, packed=is_packed), out[:40])  # 40 and 50 rows: one bucket
        assert torch.equal(linear(x[:ONEDNN_ROW_BUCKET], weight, packed=is_packed), F.linear(x[:ONEDNN_ROW_BUCKET], w))
    else:  # no native bf16: calls of UPCAST_MIN_ROWS+ rows run in float32
        assert torch.equal(out, F.linear(x.float(), w.float()).bfloat16())


def test_cpu_gemm_takes_only_what_it_can_read() -> None:
    """Regression: a weight dequantized at load can be a transposed view (GPTQ); with the CPU
    GEMM on, such a Linear keeps F.linear instead of failing, and a contiguous one takes the
    kernel for few rows only."""
    from moestream.kernels.build import load_cpu_kernels

    g = torch.Generator().manual_seed(6)
    lin = Linear(24, 40)
    lin.weight = torch.nn.Parameter(torch.randn(24, 40, generator=g).t(), requires_grad=False)  # [40, 24], strided
    set_cpu_gemm(lin, True)
    x = torch.randn(3, 24, generator=g)
    assert torch.equal(lin(x), F.linear(x, lin.weight))
    lin.weight = torch.nn.Parameter(lin.weight.contiguous(), requires_grad=False)
    if load_cpu_kernels():
        from moestream.kernels.linear import cpu_linear

        assert torch.equal(lin(x), cpu_linear(x, lin.weight))
        many = torch.randn(CPU_GEMM_MAX_ROWS + 1, 24, generator=g)
        assert torch.equal(lin(many), F.linear(many, lin.weight))
