"""Weight holders without initialisation: `Linear` and `Embedding`.

Weights are always loaded from a checkpoint, so unlike torch.nn's versions these never run
an init kernel. That keeps model construction on the meta device free of torch's lazily
imported decomposition machinery (whose first import leaves reference cycles that pinned
the constructing frames, and so the engine, until the next gc pass).
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

# Calls with at least this many rows upcast on CPUs without native bf16/fp16 matmul (below it
# the weight's conversion costs more than the slow low-precision GEMM saves; measured on an
# AVX2 core: K=N=1024, the crossover is between 4 and 16 rows).
UPCAST_MIN_ROWS = 8
# Rows per matmul call in the batch-invariant mode (`batch_invariant_linear`): padding a decode
# row to 8 costs 1.5-3x per call on the CPUs measured, a prefill's 8-row calls 2-10x.
BATCH_INVARIANT_ROW_TILE = 8


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX), so that torch's CPU
    bf16 GEMM runs at least as fast as float32. Without them (e.g. AVX2-only CPUs) torch's bf16
    and fp16 GEMMs are 4-8x slower than float32 for 16+ rows."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def upcasts(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a matmul of x with this low-precision weight computes in float32 on this CPU
    (a CPU tensor, a bf16/fp16 weight, and no native bf16 matmul)."""
    return (x.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
            and not cpu_has_native_bf16())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, row_tile: int = 0) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [..., in] @ weight[out, in].T -> [..., out], in x's dtype.

    `row_tile` > 0 is the batch-invariant mode (`batch_invariant_linear`): every row is
    computed by a call of exactly `row_tile` rows, so its result does not depend on how many
    other rows share the call. 0 (default): one call, the fastest kernel for its shape.

    On a CPU without native bf16 (`cpu_has_native_bf16()`), a bf16/fp16 call with at least
    `UPCAST_MIN_ROWS` rows computes in float32 (x and weight upcast, result rounded back to
    x's dtype). bf16/fp16 values are exact in float32 and torch's low-precision CPU GEMM also
    accumulates in float32, so the two differ only in summation order; this is 3-7x faster
    there (docs/performance.md). Weights stay in their dtype in memory. The choice depends only on
    the call's shape and the CPU, never on the memory budget.
    """
    if row_tile:
        return batch_invariant_linear(x, weight, bias, row_tile)
    if x.numel() >= UPCAST_MIN_ROWS * x.shape[-1] and upcasts(x, weight):
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(x.dtype)
    return F.linear(x, weight, bias)


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           row_tile: int) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T (+ bias) -> [..., out] in x's dtype, computed in calls of
    exactly `row_tile` rows (the last one zero-padded), so that a row's arithmetic is the same
    whatever the other rows of the batch are: BLAS kernels pick their blocking, and so their
    summation order, by the call's shape (MKL's float32 GEMM rounds a row differently at 1, 2
    and 16 rows). This is the CPU counterpart of vLLM's batch-invariant mode and SGLang's
    deterministic inference (Thinking Machines, "Defeating Nondeterminism in LLM Inference",
    2025), which fix the reduction order per row in their GPU kernels.

    On a CPU without native bf16 a bf16/fp16 weight is upcast once per call, and every tile
    then runs in float32. Raises ValueError for `row_tile` < 1.
    """
    if row_tile < 1:
        raise ValueError(f"row_tile must be >= 1, got {row_tile}")
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)  # [M, in]
    if upcasts(x, weight):
        rows, weight, bias = rows.float(), weight.float(), None if bias is None else bias.float()
    m = rows.shape[0]
    pad = -m % row_tile
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, k)])  # [M + pad, in]
    out = torch.cat([F.linear(rows[i : i + row_tile], weight, bias) for i in range(0, m + pad, row_tile)])
    return out[:m].to(x.dtype).reshape(*lead, weight.shape[0])  # [..., out]


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); x [..., in_features] -> [..., out_features]."""

    row_tile = 0  # > 0: batch-invariant mode (`batch_invariant_linear`), set per model

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.row_tile)


class Embedding(nn.Module):
    """Row lookup: ids [T] int64 -> [T, dim]."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
