"""Kimi Delta Attention (KDA; Kimi Linear, Moonshot AI 2025, arXiv 2510.26692): the gated
delta rule with a per-channel forget gate, the linear-attention layers of Kimi-Linear.

Follows transformers' KimiLinearDeltaAttention (modeling_kimi_linear.py), torch path:

    q, k, v = q_proj(x), k_proj(x), v_proj(x)                 [T, H, K] each (H heads of K)
    q, k, v = SiLU(causal depthwise conv1d) of each (q_conv1d, k_conv1d, v_conv1d, no bias)
    g = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)   [T, H, K] log-decay per channel
    beta = sigmoid(b_proj(x))                                  [T, H]
    o = KDA(l2norm(q) * K^-0.5, l2norm(k), v, g, beta)         in float32
    out = o_proj(rmsnorm(o) * o_norm.weight * sigmoid(g_b_proj(g_a_proj(x))))

Per token and head, with state S [K, V]:

    S = diag(exp(g_t)) S
    S = S + k_t (beta_t * (v_t - k_t^T S))^T
    o_t = q_t^T S

`chunk_kda` computes the same in chunks (the WY form of the gated delta rule, as
`chunk_gated_delta_rule`, with the decay per key channel); `recurrent_kda` is one step for
a batch. State per request: `conv` [3HK, K_conv-1] (the last conv inputs of q, k and v,
model dtype) and `ssm` [H, K, V] (the pool's state dtype).
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


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim (transformers' `l2norm` of Kimi-Linear)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for B sequences: q, k [B, H, K] (normalised, q scaled), v [B, H, V], g [B, H, K]
    log-decay (<= 0), beta [B, H], state [B, H, K, V], all float32 (state not modified) ->
    (o [B, H, V], new state [B, H, K, V])."""
    s = state * g.exp()[..., None]  # [B, H, K, V]
    delta = (v - torch.einsum("bhk,bhkv->bhv", k, s)) * beta[..., None]  # [B, H, V]
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, s), s


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens of one sequence, a chunk at a time: q, k [n, H, K] (normalised, q scaled), v
    [n, H, V], g [n, H, K], beta [n, H], state [H, K, V], float32 -> (o [n, H, V], final state).

    In a chunk with per-channel cumulative log-decay c_i [K] (from the chunk start) and
    D[i, j] = exp(c_i - c_j) (per channel, j <= i):
        A[i, j] = sum_k k_i D[i, j] k_j (j < i);  (I + diag(beta) A) [U | W] = [diag(beta) V | diag(beta) K exp(c)]
        V' = U - W S;  O = (Q exp(c)) S + P V' with P[i, j] = sum_k q_i D[i, j] k_j (j <= i)
        S  = diag(exp(c_last)) S + (K exp(c_last - c))^T V'
    """
    n, heads = q.shape[0], q.shape[1]
    out = torch.empty(n, heads, v.shape[-1], dtype=torch.float32, device=q.device)
    for lo in range(0, n, chunk_size):
        hi = min(lo + chunk_size, n)
        size = hi - lo
        qc, kc, vc = (x[lo:hi].transpose(0, 1) for x in (q, k, v))  # [H, L, K|V]
        c = g[lo:hi].transpose(0, 1).cumsum(dim=1)  # [H, L, K]
        bc = beta[lo:hi].T[..., None]  # [H, L, 1]
        past = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()  # j <= i
        decay = (c[:, :, None, :] - c[:, None, :, :]).masked_fill(~past[None, :, :, None], float("-inf")).exp()
        kd = kc[:, None, :, :] * decay  # [H, i, j, K]: k_j D[i, j]
        system = torch.einsum("hik,hijk->hij", kc * bc, kd)  # only its strict lower part is used
        u = torch.linalg.solve_triangular(system, vc * bc, upper=False, unitriangular=True)  # [H, L, V]
        w = torch.linalg.solve_triangular(system, kc * bc * c.exp(), upper=False, unitriangular=True)  # [H, L, K]
        attn = torch.einsum("hik,hijk->hij", qc, kd)  # [H, L, L], zero above the diagonal
        v_new = u - w @ state  # [H, L, V]
        out[lo:hi] = ((qc * c.exp()) @ state + attn @ v_new).transpose(0, 1)
        last = c[:, -1:, :]  # [H, 1, K]
        state = state * last.transpose(1, 2).exp() + (kc * (last - c).exp()).transpose(1, 2) @ v_new
    return out, state


class ShortConv(nn.Module):
    """A causal depthwise conv weight [C, 1, K] under HF's name (`q_conv1d.weight`, ...)."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size), requires_grad=False)


class KimiDeltaAttention(RecurrentMixer):
    """forward(x [T, hidden], (conv_state [S, 3HK, Kc-1], ssm_state [S, H, K, K]), meta) -> [T, hidden]
    (see the module docstring; parameters named as the checkpoint's)."""

    @classmethod
    def state_specs(cls, cfg: Any, dtype: torch.dtype, state_dtype: torch.dtype) -> tuple[StateSpec, ...]:
        """conv [3HK, Kc-1] in the model's dtype, ssm [H, K, K] in `state_dtype`."""
        h, d = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        return (StateSpec("conv", (3 * h * d, cfg.linear_conv_kernel_dim - 1), dtype),
                StateSpec("ssm", (h, d, d), state_dtype))

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int, eps: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        dim = num_heads * head_dim
        self.dim = dim
        self.q_proj, self.k_proj, self.v_proj = (Linear(hidden_size, dim, bias=False) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConv(dim, conv_kernel) for _ in range(3))
        self.f_a_proj = Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = Linear(head_dim, dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(1, 1, num_heads, 1), requires_grad=False)
        self.b_proj = Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = Linear(hidden_size, head_dim, bias=False)
        self.g_b_proj = Linear(head_dim, dim, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)
        self.eps = eps
        self.o_proj = Linear(dim, hidden_size, bias=False)

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        """SiLU(depthwise conv) of `window` [n, 3HK, Kc] (each row the Kc inputs ending at a
        token) -> [n, 3HK] float32."""
        w = torch.cat((self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight))[:, 0, :].float()  # [3HK, Kc]
        return F.silu((window.float() * w).sum(-1))

    def _heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv outputs y [n, 3HK] float32 -> q (normalised, scaled), k (normalised), v [n, H, K]."""
        n, h, d = y.shape[0], self.num_heads, self.head_dim
        q, k, v = (t.reshape(n, h, d) for t in torch.split(y, [self.dim] * 3, dim=-1))
        return _l2norm(q) * d ** -0.5, _l2norm(k), v

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta: StateMetadata) -> torch.Tensor:
        conv_state, ssm_state = state
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        mixed = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)  # [T, 3HK]
        f = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(t, h, d)
        g = -self.A_log.float().view(1, h, 1).exp() * F.softplus(f)  # [T, H, K] float32
        beta = torch.sigmoid(self.b_proj(x).float())  # [T, H]
        core = torch.empty(t, h, d, dtype=torch.float32, device=x.device)
        slots = meta.state_slots_cpu
        captures = meta.captures or [[] for _ in slots]
        km1 = conv_state.shape[2]
        step = decode_windows(meta, mixed, conv_state)
        if step is not None:  # one token each: a batched conv step and a batched recurrent step
            decodes, rows, idx, window = step
            q, k, v = self._heads(self._conv(window))
            o, new = recurrent_kda(q, k, v, g[rows], beta[rows], ssm_state[idx].float())
            ssm_state[idx] = new.to(ssm_state.dtype)
            core[rows] = o
            capture_decodes(state, meta, decodes)
        for i, start, end, window in prefill_pieces(meta, mixed, conv_state):  # window [C, Kc-1+n]
            slot = slots[i]
            q, k, v = self._heads(self._conv(window.unfold(1, km1 + 1, 1).transpose(0, 1)))  # [n, H, K]
            s = ssm_state[slot]  # [H, K, K], the pool's dtype between pieces
            lo = 0
            for hi, row in sorted(captures[i], key=lambda c: c[0]) + [(end - start, None)]:
                if hi > lo:  # tokens [lo, hi) from the state after token lo: one step, or the chunked form
                    gs, bs = g[start + lo:start + hi], beta[start + lo:start + hi]
                    if hi - lo == 1:
                        o, new = recurrent_kda(q[lo:hi], k[lo:hi], v[lo:hi], gs, bs, s.float()[None])
                        new = new[0]
                    else:
                        o, new = chunk_kda(q[lo:hi], k[lo:hi], v[lo:hi], gs, bs, s.float())
                    core[start + lo:start + hi] = o
                    s = new.to(ssm_state.dtype)
                    lo = hi
                if row is not None:
                    ssm_state[row] = s
                    conv_state[row] = window[:, hi:hi + km1]  # the last Kc-1 inputs before token hi
            ssm_state[slot] = s
        gate = self.g_b_proj(self.g_a_proj(x)).view(t, h, d)
        normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.o_norm.weight.float() * normed * torch.sigmoid(gate.float())).to(x.dtype)
        return self.o_proj(out.reshape(t, self.dim))
