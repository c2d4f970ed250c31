"""The gated delta rule (Gated DeltaNet, Yang, Kautz & Hatamizadeh 2024, arXiv 2412.06464),
in three forms that compute the same thing:

- `chunk_gated_delta_rule`: one sequence, chunks of 64 tokens; inside a chunk the delta
  updates are folded into a unit-lower-triangular solve (the WY / UT representation of
  DeltaNet, Yang et al. 2024, arXiv 2406.06484), across chunks the state is scanned. Prefill.
- `recurrent_gated_delta_rule`: one token for each of B sequences at once. Batched decode.
- `naive_gated_delta_rule`: the recurrence token by token; the reference the others are
  tested against.

All take q/k before L2 normalisation and normalise them here (in float32, eps 1e-6, as
transformers' `l2norm`), scale q by Dk^-0.5, and run in float32. Each token t with state S
(per value head, [Dk, Dv]) does:

    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - k_t^T S))^T
    o_t = q_t^T S

Value heads outnumber key heads by an integer ratio r; key head h serves value heads
h*r .. h*r+r-1 (transformers' `repeat_interleave`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., Hk, Dk] q/k, [..., Hv, Dv] v, [..., Hv] g/beta -> float32, q/k repeated to Hv
    heads and L2-normalised, q scaled by Dk^-0.5."""
    ratio = v.shape[-2] // k.shape[-2]
    if ratio != 1:
        q = q.repeat_interleave(ratio, dim=-2)
        k = k.repeat_interleave(ratio, dim=-2)
    q, k = _l2norm(q.float()), _l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for B sequences.

    Args:
        q, k: [B, Hk, Dk] any float dtype.
        v: [B, Hv, Dv].
        g: [B, Hv] log-decay (<= 0); beta: [B, Hv] in (0, 1).
        state: [B, Hv, Dk, Dv] float32, not modified.

    Returns:
        (o [B, Hv, Dv] float32, new state [B, Hv, Dk, Dv] float32).
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state * g.exp()[..., None, None]  # [B, Hv, Dk, Dv]
    predicted = torch.einsum("bhk,bhkv->bhv", k, s)  # [B, Hv, Dv]
    delta = (v - predicted) * beta[..., None]  # [B, Hv, Dv]
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, s), s


def naive_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token reference for one sequence: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta
    [T, Hv], initial_state [Hv, Dk, Dv] float32 or None (zeros).
    Returns (o [T, Hv, Dv] float32, final state [Hv, Dk, Dv] float32)."""
    hv, dk, dv = v.shape[1], k.shape[2], v.shape[2]
    s = torch.zeros(1, hv, dk, dv, device=v.device) if initial_state is None else initial_state.float()[None]
    outs = []
    for t in range(q.shape[0]):
        o, s = recurrent_gated_delta_rule(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)
        outs.append(o)
    return torch.cat(outs), s[0]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form for one sequence; same arguments and results as `naive_gated_delta_rule`.

    Within a chunk of C tokens (positions i, j; cumulative log-decay c_i from the chunk start):
        D[i, j] = exp(c_i - c_j) for j <= i, else 0
        (I + strictly_lower(diag(beta) K K^T * D)) [U | W] = [diag(beta) V | diag(beta exp(c)) K]
    then with the incoming state S:
        V' = U - W S;   O = (Q exp(c)) S + (Q K^T * D) V'
        S  = exp(c_C) S + (K exp(c_C - c))^T V'
    The math follows transformers' `torch_chunk_gated_delta_rule` (Qwen3-Next).
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    t_len, hv, dk, dv = q.shape[0], v.shape[1], q.shape[2], v.shape[2]
    pad = (-t_len) % chunk_size
    # Heads first, chunked: [Hv, N, C, D]; padded tokens have g = 0, beta = 0 (no effect).
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)).reshape(hv, -1, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)).reshape(hv, -1, chunk_size) for x in (g, beta))
    c = g.cumsum(dim=-1)  # [Hv, N, C]
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(future, float("-inf")).exp()  # [Hv, N, C, C]
    k_beta = k * beta[..., None]  # [Hv, N, C, Dk]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # [Hv, N, C, C]; its diagonal is treated as 1
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)  # [Hv, N, C, Dv]
    w = torch.linalg.solve_triangular(system, k_beta * c.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # [Hv, N, C, C]
    q_decayed = q * c.exp()[..., None]
    last = c[..., -1:]  # [Hv, N, 1]
    k_decayed = k * (last - c).exp()[..., None]  # [Hv, N, C, Dk]
    s = torch.zeros(hv, dk, dv, device=q.device) if initial_state is None else initial_state.float()
    out = torch.empty_like(u)  # [Hv, N, C, Dv]
    for n in range(q.shape[1]):
        v_new = u[:, n] - w[:, n] @ s  # [Hv, C, Dv]
        out[:, n] = q_decayed[:, n] @ s + attn[:, n] @ v_new
        s = s * last[:, n, :, None].exp() + k_decayed[:, n].transpose(-1, -2) @ v_new
    return out.reshape(hv, -1, dv)[:, :t_len].transpose(0, 1), s
