"""Gated DeltaNet token mixer (the linear-attention layers of Qwen3-Next and Qwen3.5-MoE),
over per-request state slots.

Follows transformers' Qwen3NextGatedDeltaNet / Qwen3_5MoeGatedDeltaNet:
    [q | k | v] -> causal depthwise conv1d (kernel K) -> SiLU
    g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)
    o = gated delta rule(q, k, v, g, beta) in float32   (L2-normalised q, k)
    out_proj(gated_rmsnorm(o, z))
Qwen3-Next fuses the input projections (`in_proj_qkvz`, `in_proj_ba`) and interleaves them
per key head; Qwen3.5 keeps them split (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`).

A request's state lives in a slot of the StatePool's tensors (`RecurrentMixer`, in
layers/recurrent_state.py): the conv state (its last K-1 conv inputs) and the recurrent
state. Prefill chunks run the chunked rule from the slot's state; single-token rows of the
batch (decodes) run together in one batched recurrent step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moestream.layers.gated_delta_rule import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from moestream.layers.linear import Linear
from moestream.layers.norm import GatedRMSNorm
from moestream.layers.recurrent_state import (
    RecurrentMixer,
    StateMetadata,
    StateSpec,
    capture_decodes,
    decode_windows,
    prefill_pieces,
)


class DepthwiseConv1d(nn.Module):
    """Holds the causal depthwise conv weight [C, 1, K] under HF's name `conv1d.weight`."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size), requires_grad=False)


class GatedDeltaNet(RecurrentMixer):
    """forward(x [T, hidden], (conv_state [S, C, K-1], ssm_state [S, Hv, Dk, Dv]), meta) -> [T, hidden].

    C = 2 * Hk * Dk + Hv * Dv conv channels. The states of the requests in `meta` are read
    and updated in place; ssm_state's dtype is the pool's (float32 by default), conv_state's
    the model's.
    """

    @classmethod
    def state_specs(cls, cfg: Any, dtype: torch.dtype, state_dtype: torch.dtype) -> tuple[StateSpec, ...]:
        """conv [C, K-1] in the model's dtype, ssm (the recurrent state) [Hv, Dk, Dv] in `state_dtype`."""
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
            cfg.linear_num_value_heads * cfg.linear_value_head_dim)
        return (StateSpec("conv", (conv_dim, cfg.linear_conv_kernel_dim - 1), dtype),
                StateSpec("ssm", (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                          state_dtype))

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int,
        eps: float,
        fused_projections: bool,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads {num_v_heads} must be a multiple of linear_num_key_heads {num_k_heads}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.fused = fused_projections
        if fused_projections:
            self.in_proj_qkvz = Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = Linear(hidden_size, 2 * num_v_heads, bias=False)
        else:
            self.in_proj_qkv = Linear(hidden_size, self.conv_dim, bias=False)
            self.in_proj_z = Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = Linear(hidden_size, num_v_heads, bias=False)
            self.in_proj_a = Linear(hidden_size, num_v_heads, bias=False)
        self.conv1d = DepthwiseConv1d(self.conv_dim, conv_kernel_size)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden_size, bias=False)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (mixed q|k|v [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        t = x.shape[0]
        if not self.fused:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(t, self.num_v_heads, self.head_v_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        r = self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(x).view(t, self.num_k_heads, 2 * dk + 2 * r * dv)  # interleaved per key head
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(t, self.num_k_heads, 2 * r), [r, r], dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)  # [T, C]
        return mixed, z.reshape(t, self.num_v_heads, dv), b.reshape(t, -1), a.reshape(t, -1)

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, C] -> q [n, Hk, Dk], k [n, Hk, Dk], v [n, Hv, Dv]."""
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        n = mixed.shape[0]
        return (q.reshape(n, self.num_k_heads, self.head_k_dim), k.reshape(n, self.num_k_heads, self.head_k_dim),
                v.reshape(n, self.num_v_heads, self.head_v_dim))

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta: StateMetadata) -> torch.Tensor:
        conv_state, ssm_state = state
        mixed, z, b, a = self._project(x)
        beta = b.sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv] float32
        weight = self.conv1d.weight  # [C, 1, K]
        core = torch.empty(x.shape[0], self.num_v_heads, self.head_v_dim, dtype=torch.float32, device=x.device)
        slots = meta.state_slots_cpu
        step = decode_windows(meta, mixed, conv_state)
        if step is not None:  # one token each: a batched conv step and a batched recurrent step
            decodes, rows, idx, window = step
            y = F.silu((window.to(weight.dtype) * weight[:, 0, :]).sum(-1)).to(x.dtype)  # [n, C]
            q, k, v = self._split_heads(y)
            o, new_state = recurrent_gated_delta_rule(q, k, v, g[rows], beta[rows], ssm_state[idx].float())
            ssm_state[idx] = new_state.to(ssm_state.dtype)
            core[rows] = o
            capture_decodes(state, meta, decodes)  # checkpoints after a decode token: the slot's new state
        captures = meta.captures or [[] for _ in slots]
        km1 = conv_state.shape[2]
        for i, start, end, window in prefill_pieces(meta, mixed, conv_state):  # window [C, K-1+n]
            slot = slots[i]
            y = F.silu(F.conv1d(window[None].to(weight.dtype), weight, groups=self.conv_dim))[0].T.to(x.dtype)  # [n, C]
            q, k, v = self._split_heads(y)
            state = ssm_state[slot]  # [Hv, Dk, Dv], the pool's dtype between pieces
            lo = 0
            for hi, row in sorted(captures[i], key=lambda c: c[0]) + [(end - start, None)]:
                if hi > lo:  # tokens [lo, hi) of the segment, from the state after token lo
                    rule = recurrent_gated_delta_rule if hi - lo == 1 else chunk_gated_delta_rule
                    o, new_state = rule(q[lo:hi], k[lo:hi], v[lo:hi], g[start + lo : start + hi],
                                        beta[start + lo : start + hi], state.float()[None] if hi - lo == 1 else state.float())
                    state = (new_state[0] if hi - lo == 1 else new_state).to(ssm_state.dtype)
                    core[start + lo : start + hi] = o
                    lo = hi
                if row is not None:
                    ssm_state[row] = state
                    conv_state[row] = window[:, hi : hi + km1]  # the last K-1 inputs before token hi
            ssm_state[slot] = state
        out = self.norm(core.to(x.dtype).reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))  # [T*Hv, Dv]
        return self.out_proj(out.reshape(x.shape[0], self.value_dim))
