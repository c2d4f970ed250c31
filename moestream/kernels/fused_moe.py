"""The fused CPU MoE kernel: one call per MoE layer computes every active expert's gate_up,
gated activation, down and weighted combine (`fused_moe_cpu.cpp`, a torch C++ operator
`torch.ops.moestream_cpu.fused_moe`).

The operator is compiled on first use with the machine's C++ compiler (`-O3 -march=native`,
so one build per CPU: the build directory's name carries a hash of the CPU's flags) through
`torch.utils.cpp_extension.load` and cached in its extensions directory
(`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`); the compile is logged once. With
no compiler, or a compile that fails, `load_fused_moe` logs why and returns None, and the
executors keep the PyTorch path (`moe_runner_backend` "auto").

The kernel's SIMD path (AVX-512 with AVX512_BF16's `vdpbf16ps` for bf16, AVX2 + FMA, or
scalar) is chosen by the compiler flags; `kernel_isa()` names it. Its arithmetic follows the
PyTorch path op for op (float32 accumulation, rounding to the compute dtype after each
projection and pointwise op, products added in expert order), but its dot products sum in
their own fixed order, so its outputs differ from oneDNN's in the last bits: it is held to
the HF parity tests, not to bit-equality with the PyTorch path. Each output element's sum
depends only on the reduction length, so an expert computes the same values whatever the
other rows of the batch, and the resident and paged executors, both calling it with the
experts in ascending order, agree bit for bit.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "fused_moe_cpu.cpp")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17"]

# ExpertActivation.name -> the kernel's `act` code
ACT_CODES = {"silu": 0, "swigluoai": 1}


def _cpu_tag() -> str:
    """A short hash of the CPU's model and flags (/proc/cpuinfo), so that a build made with
    -march=native on one CPU is never loaded on another sharing the cache directory."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:10]


@functools.cache
def load_fused_moe() -> bool:
    """Compile (once per CPU, then cached on disk) and load the fused MoE operator into this
    process, with the compiler torch's extension builder uses (`CXX`, else `c++`). Returns
    whether `torch.ops.moestream_cpu.fused_moe` is available; on False the reason is logged
    as a warning, once."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        logger.warning("fused MoE kernel unavailable: no C++ compiler '%s' on PATH; using the PyTorch MoE path "
                       "(install g++ for the fused kernel)", compiler)
        return False
    name = f"moestream_fused_moe_{_cpu_tag()}"
    start = time.perf_counter()
    try:
        cpp_extension.load(name=name, sources=[_SOURCE], extra_cflags=_FLAGS, is_python_module=False, verbose=False)
    except Exception as exc:  # a failed compile must not stop the engine: the PyTorch path remains
        lines = str(exc).strip().splitlines()
        logger.warning("fused MoE kernel unavailable: its build failed (%s); using the PyTorch MoE path",
                       lines[-1] if lines else type(exc).__name__)
        return False
    logger.info("fused MoE kernel ready (%s, %.1f s; built once per CPU and cached in %s)", kernel_isa(),
                time.perf_counter() - start, cpp_extension._get_build_directory(name, verbose=False))
    return True


def kernel_isa() -> str:
    """The loaded kernel's SIMD path: "avx512+bf16", "avx512", "avx2" or "scalar"."""
    return torch.ops.moestream_cpu.isa()


def fused_moe(x: torch.Tensor, gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
              bias: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None, token_of: torch.Tensor,
              pair_weight: torch.Tensor, counts: Sequence[int], act: int, alpha: float, limit: float,
              out: torch.Tensor) -> torch.Tensor:
    """out [T, H] float32 += sum over the listed experts, in order, of
    pair_weight[p] * down_e(act(gate_up_e(x[token_of[p]]))) for expert e's pairs p.

    x [T, H] float32 or bfloat16; gate_up[e] [2I, H] and down[e] [H, I] contiguous in x's
    dtype; bias: per expert (gate_up [2I], down [H]) lists, or None; token_of [P] int64 and
    pair_weight [P] float32 hold the experts' pairs one expert after another, counts[e] of
    them each; act: `ACT_CODES` (alpha, limit: swigluoai's). Returns out.

    Raises:
        RuntimeError: shapes, dtypes or layouts other than these (the operator's checks), or
            a kernel that did not build.
    """
    if not load_fused_moe():
        raise RuntimeError("the fused MoE kernel did not build (see the warning logged); use the PyTorch path")
    gu_bias, down_bias = bias if bias is not None else ([], [])
    torch.ops.moestream_cpu.fused_moe(x, list(gate_up), list(down), list(gu_bias), list(down_bias), token_of,
                                      pair_weight, list(counts), act, alpha, limit, out)
    return out
