"""The fused CPU MoE kernel: one call per MoE layer computes every active expert's gate_up,
gated activation, down and weighted combine (`fused_moe_cpu.cpp`, a torch C++ operator
`torch.ops.moestream_cpu.fused_moe`; `fused_moe_int` for weight-only int8 / int4 experts,
read in place and dequantized a work item's rows at a time into a scratch that stays in
cache, with the same dot products: its outputs equal `fused_moe`'s on the dequantized
weights bit for bit).

The operator is compiled on first use (`kernels/build.py`, `load_cpu_kernels`); without a
compiler the executors keep the PyTorch path (`moe_runner_backend` "auto"). Its SIMD path
(AVX-512 with AVX512_BF16's `vdpbf16ps` for bf16, AVX2 + FMA, or scalar) is chosen by the
compiler flags; `kernel_isa()` names it. On CPUs with AMX-BF16 (`has_amx()`) its bf16
projections take AMX tiles, the expert weights read in place as the A operand. Its arithmetic follows the
PyTorch path op for op (float32 accumulation, rounding to the compute dtype after each
projection and pointwise op, products added in expert order), but its dot products sum in
their own fixed order, so its outputs differ from oneDNN's in the last bits: it is held to
the HF parity tests, not to bit-equality with the PyTorch path. Each output element's sum
depends only on the reduction length, so an expert computes the same values whatever the
other rows of the batch, and the resident and paged executors, both calling it with the
experts in ascending order, agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moestream.kernels.build import load_cpu_kernels
from moestream.kernels.linear import has_amx
from moestream.quantization.method import IntWeights

# ExpertActivation.name -> the kernel's `act` code
ACT_CODES = {"silu": 0, "swigluoai": 1}


def _ready(bias: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None
           ) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
    """The (gate_up, down) bias lists an operator takes (empty for none), once the kernels are
    loaded. Raises RuntimeError when they did not build."""
    if not load_cpu_kernels():
        raise RuntimeError("the CPU kernels did not build (see the warning logged); use the PyTorch path")
    return bias if bias is not None else ([], [])


def fused_moe(x: torch.Tensor, gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
              bias: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None, token_of: torch.Tensor,
              pair_weight: torch.Tensor, counts: Sequence[int], act: int, alpha: float, limit: float,
              out: torch.Tensor, amx: bool | None = None) -> torch.Tensor:
    """out [T, H] float32 += sum over the listed experts, in order, of
    pair_weight[p] * down_e(act(gate_up_e(x[token_of[p]]))) for expert e's pairs p.
    amx: bf16 projections through AMX tiles (where H and I are multiples of 32; the others
    keep the AVX-512 dot products); None: wherever `has_amx()`. Both are batch-invariant but
    may differ from each other in the last bit.

    x [T, H] float32 or bfloat16; gate_up[e] [2I, H] and down[e] [H, I] contiguous in x's
    dtype; bias: per expert (gate_up [2I], down [H]) lists, or None; token_of [P] int64 and
    pair_weight [P] float32 hold the experts' pairs one expert after another, counts[e] of
    them each; act: `ACT_CODES` (alpha, limit: swigluoai's). Returns out.

    Raises:
        RuntimeError: shapes, dtypes or layouts other than these (the operator's checks), or
            a kernel that did not build.
    """
    gu_bias, down_bias = _ready(bias)
    torch.ops.moestream_cpu.fused_moe(x, list(gate_up), list(down), list(gu_bias), list(down_bias), token_of,
                                      pair_weight, list(counts), act, alpha, limit,
                                      has_amx() if amx is None else amx, out)
    return out


def fused_moe_int(x: torch.Tensor, experts: Sequence[tuple[list[IntWeights], IntWeights]],
                  bias: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None, token_of: torch.Tensor,
                  pair_weight: torch.Tensor, counts: Sequence[int], act: int, alpha: float, limit: float,
                  out: torch.Tensor, amx: bool | None = None) -> torch.Tensor:
    """`fused_moe` over weight-only integer experts: experts[e] = (gate_up in 1 or 2 row
    blocks, down), as `quantization/packed.py`'s `int_expert` gives them (every block of one
    bit width, flip and group size). The rest as `fused_moe`. Returns out.

    Raises:
        RuntimeError: shapes, dtypes or layouts other than these (the operator's checks), or
            a kernel that did not build.
    """
    gu_bias, down_bias = _ready(bias)
    blocks = [b for gate_up, _ in experts for b in gate_up]
    downs = [d for _, d in experts]
    first = downs[0]
    zero = first.zero is not None
    torch.ops.moestream_cpu.fused_moe_int(
        x, [b.q for b in blocks], [b.scale for b in blocks], [b.zero for b in blocks] if zero else [],
        len(experts[0][0]), [d.q for d in downs], [d.scale for d in downs], [d.zero for d in downs] if zero else [],
        first.bits, first.flip, first.group_size, first.shape[1],
        list(gu_bias), list(down_bias), token_of, pair_weight, list(counts), act, alpha, limit,
        has_amx() if amx is None else amx, out)
    return out
