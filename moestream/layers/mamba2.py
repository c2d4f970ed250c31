"""Mamba-2 token mixer (the SSM layers of Granite-4.0-H; Nemotron-H's are the same mixer),
over per-request state slots (`RecurrentMixer`).

Follows transformers' GraniteMoeHybridMambaLayer / Mamba2Mixer, torch path:

    [gate | xBC | dt] = in_proj(x)                         gate [T, I], xBC [T, C], dt [T, H]
    xBC = SiLU(causal depthwise conv1d(xBC) + bias)        C = I + 2 * G * N
    [x | B | C] = xBC                                      x [T, H, P], B, C [T, G, N]
    dt = softplus(dt + dt_bias) (clamped to time_step_limit),  A = -exp(A_log)
    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t (outer) B_t  per head, h [H, P, N] float32
    y_t = h_t . C_t + D * x_t
    out_proj(grouped_rmsnorm(y * SiLU(gate)))             G groups of I / G channels

Head h reads B and C of group h // (H / G). The SSD algorithm (Mamba-2 paper, "Transformers
are SSMs", Dao & Gu 2024) computes the same recurrence in chunks; here a prefill runs the
recurrence token by token, in float32, which is exact but not yet chunked.

State per request: `conv` [C, K-1] (the last K-1 conv inputs, model dtype) and `ssm`
[H, P, N] (the pool's state dtype, float32 by default).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moestream.layers.linear import Linear
from moestream.layers.recurrent_state import (
    RecurrentMixer,
    StateMetadata,
    StateSpec,
    capture_decodes,
    prefill_pieces,
)


class GroupedGatedRMSNorm(nn.Module):
    """weight * rmsnorm_per_group(x * SiLU(gate)) in float32 (transformers'
    GraniteMoeHybridRMSNormGated / MambaRMSNormGated with n_groups); x, gate [T, I]."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(RecurrentMixer):
    """forward(x [T, hidden], (conv_state [S, C, K-1], ssm_state [S, H, P, N]), meta) -> [T, hidden]
    (see the module docstring; parameters named as HF's)."""

    @classmethod
    def state_specs(cls, cfg: Any, dtype: torch.dtype, state_dtype: torch.dtype) -> tuple[StateSpec, ...]:
        """conv [I + 2GN, K-1] in the model's dtype, ssm [H, P, N] in `state_dtype`."""
        m = cfg.mamba
        return (StateSpec("conv", (m.conv_dim, m.conv_kernel - 1), dtype),
                StateSpec("ssm", (m.num_heads, m.head_dim, m.state_size), state_dtype))

    def __init__(self, hidden_size: int, m: Any, eps: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.state_size, self.num_groups = m.num_heads, m.head_dim, m.state_size, m.num_groups
        self.inner = m.num_heads * m.head_dim
        self.conv_dim = m.conv_dim
        self.time_step_limit = m.time_step_limit
        self.in_proj = Linear(hidden_size, self.inner + self.conv_dim + m.num_heads, bias=m.proj_bias)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, m.conv_kernel), requires_grad=False)
        self.conv1d.bias = nn.Parameter(torch.empty(self.conv_dim), requires_grad=False) if m.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(m.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(m.num_heads), requires_grad=False)
        self.norm = GroupedGatedRMSNorm(self.inner, self.inner // m.num_groups, eps)
        self.out_proj = Linear(self.inner, hidden_size, bias=m.proj_bias)

    def _conv_out(self, window: torch.Tensor) -> torch.Tensor:
        """SiLU(depthwise conv + bias) of `window` [n, C, K] (each row the K inputs ending at a
        token) -> [n, C] float32."""
        w = self.conv1d.weight[:, 0, :].float()  # [C, K]
        y = (window.float() * w).sum(-1)
        if self.conv1d.bias is not None:
            y = y + self.conv1d.bias.float()
        return F.silu(y)

    def _step(self, state: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One recurrence step of n requests: state [n, H, P, N] float32, xbc [n, C] float32,
        dt [n, H] float32 (after softplus) -> (y [n, H, P], new state)."""
        n = xbc.shape[0]
        x, B, C = torch.split(xbc, [self.inner, self.num_groups * self.state_size, self.num_groups * self.state_size],
                              dim=-1)
        x = x.view(n, self.num_heads, self.head_dim)
        rep = self.num_heads // self.num_groups
        B = B.view(n, self.num_groups, 1, self.state_size).expand(-1, -1, rep, -1).reshape(n, self.num_heads, self.state_size)
        C = C.view(n, self.num_groups, 1, self.state_size).expand(-1, -1, rep, -1).reshape(n, self.num_heads, self.state_size)
        dA = torch.exp(dt * A)  # [n, H]
        state = state * dA[:, :, None, None] + (dt[:, :, None] * x)[..., None] * B[:, :, None, :]
        y = (state * C[:, :, None, :]).sum(-1) + self.D.float()[:, None] * x  # [n, H, P]
        return y, state

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta: StateMetadata) -> torch.Tensor:
        conv_state, ssm_state = state
        t = x.shape[0]
        gate, xbc_in, dt = torch.split(self.in_proj(x), [self.inner, self.conv_dim, self.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())  # [T, H]
        lo_lim, hi_lim = self.time_step_limit
        if lo_lim > 0.0 or hi_lim != float("inf"):
            dt = dt.clamp(lo_lim, hi_lim)
        A = -torch.exp(self.A_log.float())  # [H]
        y = torch.empty(t, self.num_heads, self.head_dim, dtype=torch.float32, device=x.device)
        qsl, slots = meta.query_start_loc_cpu, meta.state_slots_cpu
        captures = meta.captures or [[] for _ in slots]
        km1 = conv_state.shape[2]
        decodes = [i for i in range(len(slots)) if qsl[i + 1] - qsl[i] == 1]
        if decodes:  # one token each: a batched conv step and a batched recurrence step
            rows = torch.tensor([qsl[i] for i in decodes], device=x.device)
            idx = meta.state_slots[decodes] if len(decodes) < len(slots) else meta.state_slots
            window = torch.cat((conv_state[idx], xbc_in[rows, :, None].to(conv_state.dtype)), dim=-1)  # [n, C, K]
            conv_state[idx] = window[:, :, 1:]
            out, new_state = self._step(ssm_state[idx].float(), self._conv_out(window), dt[rows], A)
            ssm_state[idx] = new_state.to(ssm_state.dtype)
            y[rows] = out
            capture_decodes(state, meta, decodes)
        for i, start, end, window in prefill_pieces(meta, xbc_in, conv_state):  # window [C, K-1+n]
            slot = slots[i]
            xbc = self._conv_out(window.unfold(1, km1 + 1, 1).transpose(0, 1))  # [n, C]
            h = ssm_state[slot].float()[None]  # [1, H, P, N]
            cap = {off: row for off, row in captures[i] if row is not None}
            for j in range(end - start):
                out, h = self._step(h, xbc[j:j + 1], dt[start + j:start + j + 1], A)
                y[start + j] = out[0]
                row = cap.get(j + 1)
                if row is not None:
                    ssm_state[row] = h[0].to(ssm_state.dtype)
                    conv_state[row] = window[:, j + 1:j + 1 + km1]  # the last K-1 inputs before token j + 1
            ssm_state[slot] = h[0].to(ssm_state.dtype)
        out = self.norm(y.view(t, self.inner).to(x.dtype), gate)
        return self.out_proj(out)
