"""Pointwise activations (`silu`, `sigmoid`) with a batch-invariant form.

torch's CPU pointwise kernels (aten/src/ATen/native/cpu/Loops.h, `vectorized_loop`) run two
SIMD vectors of elements at a time and the rest of each call, and of each thread's share of a
large call, in scalar code. The vector exp (Sleef) and the scalar one (libm) round
differently in the last bit, so in float32 an element's silu or sigmoid depends on where it
falls in the call: on how many rows the batch has, whenever a row's width is not a multiple
of the vector step (measured: width 100 or 8, 2-21 of 70 rows differ from the same row
alone). `aligned_pointwise` puts every element through the vector path.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

# Row width is padded to a multiple of this (elements): two vectors of the widest type,
# 2 x 32 bf16 lanes of AVX-512.
_ALIGN = 64
# Elements per call: a multiple of _ALIGN below torch's parallel grain (at::internal::GRAIN_SIZE,
# 32768), so a call is never split between threads at an unaligned offset.
_SLICE = 16384


def aligned_pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for a lane-wise `fn` (silu, sigmoid), computed so that every element takes the
    SIMD path whatever the tensor's shape: x [..., W] is zero-padded to [..., ceil(W/64)*64],
    flattened, and run in single-thread calls of 16384 elements (each a multiple of two
    vectors, so none has a scalar remainder). Returns [..., W] in fn's dtype. Off CPU it is
    `fn(x)` (GPU pointwise kernels have no scalar tail)."""
    if x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    w = x.shape[-1]
    pad = -w % _ALIGN
    rows = F.pad(x.reshape(-1, w), (0, pad)) if pad else x.reshape(-1, w).contiguous()  # [R, W + pad]
    flat = rows.view(-1)
    out = torch.cat([fn(flat[i : i + _SLICE]) for i in range(0, flat.numel(), _SLICE)])
    return out.view(rows.shape)[:, :w].reshape(x.shape)  # [..., W]


def silu(x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """x * sigmoid(x), x's shape and dtype; `invariant`: `aligned_pointwise` (batch-invariant mode)."""
    return aligned_pointwise(F.silu, x) if invariant else F.silu(x)


def sigmoid(x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """1 / (1 + exp(-x)), x's shape and dtype; `invariant`: `aligned_pointwise`."""
    return aligned_pointwise(torch.sigmoid, x) if invariant else torch.sigmoid(x)
