"""Pointwise activations (`silu`, `sigmoid`) with a batch-invariant form, and the routed
experts' gated activations (`gated_activation`: SwiGLU, gpt-oss's clamped "swigluoai").

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

from moestream.config import EXPERT_ACTIVATIONS, ExpertActivation

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


def gated_activation(y: torch.Tensor, act: ExpertActivation) -> torch.Tensor:
    """An expert's activation: y [n, 2I] (its gate_up projection; [n, I] ungated) -> [n, I], y's dtype.

    "silu": silu(y[:, :I]) * y[:, I:], with the aligned silu (the resident executor may run
    it over many experts' rows at once, the paged one per expert; torch's scalar tail would
    round some elements differently otherwise). "swigluoai": gate = y[:, 0::2], up =
    y[:, 1::2], gate.clamp(max=limit), up.clamp(-limit, limit), (up + 1) * gate *
    sigmoid(alpha * gate), op for op as transformers' `GptOssExperts._apply_gate`. "relu2"
    (ungated, y [n, I] the up projection): relu(y)^2, as transformers' ReLUSquaredActivation.

    Raises:
        ValueError: an activation name not in EXPERT_ACTIVATIONS.
    """
    if act.name == "silu":
        gate, up = y.chunk(2, dim=-1)  # [n, I] each
        return silu(gate, invariant=True) * up
    if act.name == "swigluoai":
        gate, up = y[..., 0::2], y[..., 1::2]  # [n, I] each
        gate = gate.clamp(min=None, max=act.limit)
        up = up.clamp(min=-act.limit, max=act.limit)
        return (up + 1) * (gate * sigmoid(gate * act.alpha, invariant=True))
    if act.name == "relu2":
        return torch.square(F.relu(y))
    raise ValueError(f"unsupported expert activation '{act.name}'; supported: {', '.join(EXPERT_ACTIVATIONS)}")
