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

Head h reads B and C of group h // (H / G). A prefill runs the SSD form of the recurrence
(Mamba-2 paper, "Transformers are SSMs", Dao & Gu 2024, section 6) in chunks of
`chunk_size` tokens, in float32, piece by piece between the state captures (prefix-cache
checkpoints), from the state in the pool's dtype; a one-token piece, a decode token and a
speculative verify position run the recurrent step.

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
    decode_windows,
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
        self.chunk_size = m.chunk_size
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

    def _scan(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, h: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The SSD form of n >= 2 recurrence steps of one request, a chunk of `chunk_size`
        tokens at a time (Mamba-2 paper, section 6; the chunked scan of transformers'
        `torch_forward`, one chunk after another): xbc [n, C] float32 (after the conv), dt
        [n, H] float32 (after softplus), A [H], h [H, P, N] float32 (the state before) ->
        (y [n, H, P] float32 with the D skip, the state after [H, P, N] float32).

        In a chunk of L tokens with a_t = dt_t * A and segsum[t, s] = a_{s+1} + ... + a_t
        (summed per pair, not as a difference of cumulative sums):
            y_t = sum_{s<=t} (C_t . B_s) exp(segsum[t, s]) dt_s x_s + exp(a_0 + ... + a_t) C_t . h + D x_t
            h'  = exp(a_0 + ... + a_{L-1}) h + sum_s exp(segsum[L-1, s]) dt_s x_s (outer) B_s
        """
        n, heads, rep = xbc.shape[0], self.num_heads, self.num_heads // self.num_groups
        x, B, C = torch.split(xbc, [self.inner, self.num_groups * self.state_size, self.num_groups * self.state_size],
                              dim=-1)
        x = x.reshape(n, heads, self.head_dim)  # [n, H, P]
        B = B.reshape(n, self.num_groups, self.state_size).repeat_interleave(rep, dim=1)  # [n, H, N]
        C = C.reshape(n, self.num_groups, self.state_size).repeat_interleave(rep, dim=1)  # [n, H, N]
        D = self.D.float()[:, None]  # [H, 1]
        y = torch.empty(n, heads, self.head_dim, dtype=torch.float32, device=xbc.device)
        for lo in range(0, n, self.chunk_size):
            hi = min(lo + self.chunk_size, n)
            size = hi - lo
            xc, Bc, Cc, dtc = x[lo:hi], B[lo:hi], C[lo:hi], dt[lo:hi].T  # dtc [H, L]
            a = dtc * A[:, None]  # [H, L]
            below = torch.ones(size, size, dtype=torch.bool, device=xbc.device).tril(-1)
            seg = a[:, :, None].expand(heads, size, size).masked_fill(~below, 0.0).cumsum(dim=1)  # [H, t, s]
            seg = seg.masked_fill(~torch.ones_like(below).tril(), float("-inf"))
            decay = torch.exp(seg)  # [H, t, s], 0 above the diagonal
            scores = torch.einsum("thn,shn->hts", Cc, Bc) * decay * dtc[:, None, :]  # [H, t, s]
            cum = torch.cumsum(a, dim=1)  # [H, L]
            y[lo:hi] = (torch.einsum("hts,shp->thp", scores, xc)
                        + torch.einsum("thn,hpn->thp", Cc, h) * torch.exp(cum).T[:, :, None] + D * xc)
            to_end = decay[:, -1, :] * dtc  # [H, s]
            h = h * torch.exp(cum[:, -1])[:, None, None] + torch.einsum("hs,shp,shn->hpn", to_end, xc, Bc)
        return y, h

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
        slots = meta.state_slots_cpu
        captures = meta.captures or [[] for _ in slots]
        km1 = conv_state.shape[2]
        step = decode_windows(meta, xbc_in, conv_state)
        if step is not None:  # one token each: a batched conv step and a batched recurrent step
            decodes, rows, idx, window = step
            out, new_state = self._step(ssm_state[idx].float(), self._conv_out(window), dt[rows], A)
            ssm_state[idx] = new_state.to(ssm_state.dtype)
            y[rows] = out
            capture_decodes(state, meta, decodes)
        for i, start, end, window in prefill_pieces(meta, xbc_in, conv_state):  # window [C, K-1+n]
            slot = slots[i]
            xbc = self._conv_out(window.unfold(1, km1 + 1, 1).transpose(0, 1))  # [n, C]
            h = ssm_state[slot]  # [H, P, N], the pool's dtype between pieces
            lo = 0
            for hi, row in sorted(captures[i], key=lambda c: c[0]) + [(end - start, None)]:
                if hi > lo:  # tokens [lo, hi) from the state after token lo: one step, or the chunked scan
                    if hi - lo == 1:
                        out, new = self._step(h.float()[None], xbc[lo:hi], dt[start + lo:start + hi], A)
                        out, new = out, new[0]
                    else:
                        out, new = self._scan(xbc[lo:hi], dt[start + lo:start + hi], A, h.float())
                    y[start + lo:start + hi] = out
                    h = new.to(ssm_state.dtype)
                    lo = hi
                if row is not None:
                    ssm_state[row] = h
                    conv_state[row] = window[:, hi:hi + km1]  # the last K-1 inputs before token hi
            ssm_state[slot] = h
        out = self.norm(y.view(t, self.inner).to(x.dtype), gate)
        return self.out_proj(out)
