"""The recurrent-state interface a linear-attention mixer implements (Gated DeltaNet, Mamba-2
and Kimi Delta Attention; `decode_windows` and `prefill_pieces` are their shared conv-state
bookkeeping).

The engine's state machinery (`StatePool` slots and their host tier, the prefix cache's state
checkpoints, speculative rollback rows, the coordinator) only sees what this module names:
- `StateSpec`: one state tensor of a layer (its name, its shape without the row axis, its
  dtype). A layer's state is a tuple of tensors in its specs' order; the pool keeps one
  [rows, *shape] tensor per spec and layer.
- `StateMetadata`: where each request of the step keeps its state (its pool row), and the
  offsets at which the mixer must also write the state into other rows.
- `RecurrentMixer`: the layer. Its forward reads and writes the state rows of the step's
  requests, and
  - runs a prefill in pieces that end at the capture offsets, writing the state after each
    piece to its capture row (prefix-cache checkpoints, taken inside a chunked prefill);
  - runs a one-token row (decode) as a single recurrent step;
  - in a speculative verify (captures at every offset but the last) writes the state after
    each draft position, so that a rejected draft is rolled back by copying a row.

vLLM's counterpart is its MambaBase / `get_state_shape` / `get_state_dtype` per mixer
(vllm/model_executor/layers/mamba/abstract.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of a recurrent layer.

    Attributes:
        name: e.g. "conv", "ssm" (also how the pool's `tensors` are keyed).
        shape: the per-request shape (no row axis), in elements.
        dtype: its dtype.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of one request's tensor."""
        return torch.Size(self.shape).numel() * torch.tensor([], dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StateMetadata:
    """Where each request of the step keeps its recurrent state.

    Attributes:
        query_start_loc_cpu: [B + 1] request i owns rows [q[i], q[i+1]) of the flat batch.
        state_slots_cpu: [B] the StatePool slot of request i.
        state_slots: the same, as an int64 tensor on the device.
        captures: [B] per request, (offset, row or None) pairs (prefix-cache state
            checkpoints): after the first `offset` of its new tokens (1 <= offset <= its
            count), the state is also written to tensor row `row`. A prefill is computed
            in pieces that end at these offsets (also where `row` is None: a position
            checkpointed already), so a hit that restores a checkpoint and computes from
            there runs the same pieces as the miss did. A speculative verify captures at
            every offset but the last (pieces of one token run the recurrent step decode
            runs).
    """

    query_start_loc_cpu: list[int]
    state_slots_cpu: list[int]
    state_slots: torch.Tensor
    captures: list[list[tuple[int, int | None]]] | None = None


def capture_decodes(states: tuple[torch.Tensor, ...], meta: StateMetadata, decodes: list[int]) -> None:
    """Write the checkpoints asked for after a decode token (`meta.captures` of the one-token
    requests `decodes`): each is the slot's new state, copied in every state tensor."""
    if not meta.captures:
        return
    for i in decodes:
        for _, row in meta.captures[i]:
            if row is not None:
                for t in states:
                    t[row] = t[meta.state_slots_cpu[i]]


def decode_windows(meta: StateMetadata, inputs: torch.Tensor, conv_state: torch.Tensor
                   ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The one-token requests of a step (decodes), for a mixer with a causal conv: (their
    indices i, their rows of `inputs` [n], their state slots [n], windows [n, C, K]: each
    slot's conv state with the token's conv input `inputs` [T, C] appended), the slots' conv
    states advanced by one token; None when the step has no decode."""
    qsl, slots = meta.query_start_loc_cpu, meta.state_slots_cpu
    decodes = [i for i in range(len(slots)) if qsl[i + 1] - qsl[i] == 1]
    if not decodes:
        return None
    rows = torch.tensor([qsl[i] for i in decodes], device=inputs.device)
    idx = meta.state_slots[decodes] if len(decodes) < len(slots) else meta.state_slots
    window = torch.cat((conv_state[idx], inputs[rows, :, None].to(conv_state.dtype)), dim=-1)  # [n, C, K]
    conv_state[idx] = window[:, :, 1:]
    return decodes, rows, idx, window


def prefill_pieces(meta: StateMetadata, inputs: torch.Tensor, conv_state: torch.Tensor
                   ) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """The multi-token requests of a step, for a mixer with a causal conv: per request
    (index i, first row, end row, window [C, K-1+n]), its conv inputs `inputs` [T, C] rows
    appended to its conv state, whose slot is advanced to the window's last K-1 columns
    (the last K-1 conv inputs before token j of the request are window[:, j:j+K-1])."""
    qsl, slots = meta.query_start_loc_cpu, meta.state_slots_cpu
    km1 = conv_state.shape[2]
    for i in range(len(slots)):
        start, end = qsl[i], qsl[i + 1]
        if end - start == 1:
            continue
        window = torch.cat((conv_state[slots[i]], inputs[start:end].T.to(conv_state.dtype)), dim=-1)
        conv_state[slots[i]] = window[:, window.shape[1] - km1:]
        yield i, start, end, window


class RecurrentMixer(nn.Module):
    """Base of the token mixers whose per-request memory is a fixed-size state (see the
    module docstring).

    forward(x [T, H] model dtype, states: the layer's state tensors, one per `state_specs`
            entry, each [rows, *spec.shape], meta: StateMetadata) -> [T, H]
    """

    @classmethod
    def state_specs(cls, cfg: Any, dtype: torch.dtype, state_dtype: torch.dtype) -> tuple[StateSpec, ...]:
        """The state tensors of one layer of this mixer for model config `cfg`; `dtype` is
        the model's, `state_dtype` the recurrent state's (`mamba_ssm_cache_dtype`)."""
        raise NotImplementedError
