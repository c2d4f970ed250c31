"""Build and load moestream's CPU kernels: the C++ operators of `moestream_cpu`
(`fused_moe_cpu.cpp`: the fused MoE layer; `linear_cpu.cpp`: dense linears of few rows;
`norm_cpu.cpp`: RMSNorm with the residual add; `rotary_cpu.cpp`: rotary embedding in place;
`paged_attention_cpu.cpp`: decode attention over the paged KV cache; `sampling_cpu.cpp`:
greedy argmax), compiled together as one torch extension.

They are compiled on first use with the machine's C++ compiler (`-O3 -march=native`, so one
build per CPU and per source: the build's name carries a hash of the CPU's model and flags
and one of the sources) through
`torch.utils.cpp_extension.load`, and cached in its extensions directory
(`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`); the compile is logged once.
With no compiler, or a compile that fails, `load_cpu_kernels` logs why and returns False, and
the engine keeps its PyTorch paths.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time

import torch

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(__file__)
_SOURCES = [os.path.join(_HERE, name) for name in ("fused_moe_cpu.cpp", "linear_cpu.cpp", "norm_cpu.cpp",
                                                        "rotary_cpu.cpp", "paged_attention_cpu.cpp", "sampling_cpu.cpp",
                                                        "decoder_layer_cpu.cpp")]
_HEADERS = [os.path.join(_HERE, name) for name in ("simd.h", "gemm.h", "amx.h")]
# -fopenmp: at::parallel_for is an OpenMP region compiled into the caller; without the flag it
# runs on one thread whatever torch's thread count (the GOMP symbols resolve to torch's runtime)
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-fopenmp"]


def _cpu_tag() -> str:
    """A short hash of the CPU's model and flags (/proc/cpuinfo), so that a build made with
    -march=native on one CPU is never loaded on another sharing the cache directory."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:10]


def _source_tag() -> str:
    """A short hash of the compiler flags and the kernels' sources and headers: torch's
    extension versioning hashes the listed sources only, so an edited header or flag would
    otherwise load a stale build."""
    digest = hashlib.sha256(" ".join(_FLAGS).encode())
    for path in _SOURCES + _HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:10]


@functools.cache
def load_cpu_kernels() -> bool:
    """Compile (once per CPU, then cached on disk) and load the `moestream_cpu` operators
    into this process, with the compiler torch's extension builder uses (`CXX`, else `c++`).
    Returns whether they are available; on False the reason is logged as a warning, once."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        logger.warning("moestream's CPU kernels unavailable: no C++ compiler '%s' on PATH; using the PyTorch paths "
                       "(install g++ for the fused MoE and paged attention kernels)", compiler)
        return False
    name = f"moestream_cpu_kernels_{_cpu_tag()}_{_source_tag()}"
    start = time.perf_counter()
    try:
        cpp_extension.load(name=name, sources=_SOURCES, extra_cflags=_FLAGS, is_python_module=False, verbose=False)
    except Exception as exc:  # a failed compile must not stop the engine: the PyTorch paths remain
        lines = str(exc).strip().splitlines()
        logger.warning("moestream's CPU kernels unavailable: their build failed (%s); using the PyTorch paths",
                       lines[-1] if lines else type(exc).__name__)
        return False
    logger.info("CPU kernels ready (%s, %.1f s; built once per CPU and cached in %s)", kernel_isa(),
                time.perf_counter() - start, cpp_extension._get_build_directory(name, verbose=False))
    return True


def kernel_isa() -> str:
    """The loaded kernels' SIMD path: "avx512+bf16", "avx512", "avx2" or "scalar"."""
    return torch.ops.moestream_cpu.isa()
