"""`moestream.layers.linear.linear`: F.linear, computed in float32 for bf16/fp16 calls of many
rows on CPUs without native bf16 matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moestream.layers.linear import UPCAST_MIN_ROWS, cpu_has_native_bf16, linear


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
