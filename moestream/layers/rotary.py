"""Rotary position embedding (RoPE, Su et al. 2021) with the scaling types our configs use.

Inverse-frequency formulas follow transformers' `modeling_rope_utils.py`:
default, linear (position interpolation), yarn (Peng et al. 2023, arXiv 2309.00071)
and llama3. Other types are refused by `models.hf_config.model_config_from_hf`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moestream.config import RopeConfig
from moestream.kernels.rotary import cpu_apply_rotary


def rope_inv_freq(rope: RopeConfig, rotary_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] float32 and the cos/sin scale (yarn's attention factor).

    Raises:
        ValueError: an unsupported rope type, or a scaling type missing a required key.
    """
    base = rope.theta
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim  # [dim/2]
    inv_freq = 1.0 / (base**exps)
    kind = rope.rope_type
    try:
        if kind == "default":
            return inv_freq, 1.0
        if kind == "linear":
            return inv_freq / float(rope.get("factor")), 1.0
        if kind == "llama3":
            return _llama3(inv_freq, rope), 1.0
        if kind == "yarn":
            return _yarn(rope, rotary_dim, max_position_embeddings)
    except TypeError as e:  # a required key was None
        raise ValueError(f"rope_scaling of type '{kind}' is missing a required key: {dict(rope.params)}") from e
    raise ValueError(f"unsupported rope type '{kind}'")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    factor = float(rope.get("factor"))
    low, high = float(rope.get("low_freq_factor")), float(rope.get("high_freq_factor"))
    old_len = float(rope.get("original_max_position_embeddings"))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    base = rope.theta
    orig = rope.get("original_max_position_embeddings")
    factor = rope.get("factor") or max_pos / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.get("attention_factor")
    if attn is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)  # [dim/2]
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn)


class RotaryEmbedding(nn.Module):
    """Applies RoPE (rotate-half layout, as HF Llama/Qwen/Mixtral) to q and k.

    With `partial_rotary_factor` < 1 (Qwen3-Next, Qwen3.5), only the first
    R = int(head_dim * factor) dims of each head rotate; the rest pass through
    (transformers' glm-style `apply_rotary_pos_emb`).

    M-RoPE (Qwen2-VL, arXiv 2409.12191; interleaved as Qwen3-VL / Qwen3.5): with
    `mrope_section` (t, h, w), positions may be [3, T] (temporal, height, width). Frequency j
    takes the height position when j % 3 == 1 and j < 3h, the width position when
    j % 3 == 2 and j < 3w, else the temporal one (HF `Qwen3_5MoeTextRotaryEmbedding.
    recomposition_frequencies`). Text positions are equal on the three axes, so [T] positions
    are the same as [3, T] copies of them.

    `interleaved` (DeepSeek's layout, HF `apply_rotary_emb` / `apply_rotary_pos_emb_interleave`):
    the rotated pairs are adjacent dims (x0, x1), (x2, x3) ..., pair j at frequency j.

    forward(positions [T] or [3, T] int64, q [T, Hq, D], k [T, Hk, D]) -> (q, k) rotated, same dtypes.
    With `cpu_kernel` (set by `set_cpu_rotary`) float32 / bf16 q and k whose last dim is
    contiguous are rotated in place by one C++ call (`kernels/rotary.py`), with the same values.
    cos and sin are computed once for a forward's positions and reused by every layer.
    """

    cpu_kernel = False  # moestream's C++ rotary embedding (`set_cpu_rotary`), set per model

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        max_position_embeddings: int,
        device: torch.device,
        partial_rotary_factor: float = 1.0,
        mrope_section: tuple[int, int, int] | None = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.interleaved = interleaved
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        inv_freq, self.scale = rope_inv_freq(rope, self.rotary_dim, max_position_embeddings)
        # Computed on the CPU explicitly, so that building the model under a meta-device context works.
        self.inv_freq = inv_freq.to(device)  # [R/2] float32
        self.mrope_axis: torch.Tensor | None = None  # [R/2] int64: which of (t, h, w) frequency j reads
        # the last positions' (copy, dtype, cos, sin): every layer of a forward gets the same positions
        self._tables: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        if mrope_section is not None:
            j = torch.arange(self.rotary_dim // 2, device="cpu")
            axis = torch.zeros_like(j)
            axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
            axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
            self.mrope_axis = axis.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions`: [T, R] in `dtype` (rotate-half), or [T, R/2] float32
        (interleaved), times the rope's attention scale. On CPU, reused while the positions'
        values and the dtype stay the same (compared, not assumed); on an accelerator the
        comparison would sync the host every layer, so they are computed each call."""
        c, cached = self._tables, positions.device.type == "cpu"
        if (cached and c is not None and c[1] == dtype and c[0].shape == positions.shape
                and torch.equal(c[0], positions)):
            return c[2], c[3]
        if positions.dim() == 2:  # M-RoPE [3, T]: frequency j at its axis's position
            if self.mrope_axis is None:
                raise ValueError("3-D positions need a rotary embedding built with mrope_section")
            freqs = positions[self.mrope_axis].float().T * self.inv_freq[None, :]  # [T, R/2]
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, R/2]
        if self.interleaved:
            cos, sin = freqs.cos() * self.scale, freqs.sin() * self.scale  # [T, R/2] float32
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
            cos, sin = (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)
        if cached:
            self._tables = (positions.clone(), dtype, cos, sin)
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        if (self.cpu_kernel and q.dtype in (torch.float32, torch.bfloat16) and k.dtype == q.dtype and q.dim() == 3
                and k.dim() == 3 and q.stride(-1) == 1 and k.stride(-1) == 1):
            cpu_apply_rotary(q, k, cos, sin, self.interleaved)
            return q, k
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R] in q's dtype; interleaved: [T, 1, R/2] float32
        if self.interleaved:
            return _rotate_pairs(q, cos, sin, self.rotary_dim), _rotate_pairs(k, cos, sin, self.rotary_dim)
        r = self.rotary_dim
        if r == q.shape[-1]:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q_rot = q[..., :r] * cos + _rotate_half(q[..., :r]) * sin  # [T, Hq, R]
        k_rot = k[..., :r] * cos + _rotate_half(k[..., :r]) * sin
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)


def set_cpu_rotary(model: nn.Module, on: bool) -> None:
    """Route every `RotaryEmbedding` of `model` through moestream's C++ rotary embedding
    (`kernels/rotary.py`) for float32 / bf16 q and k on CPU, or never."""
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.cpu_kernel = on and m.inv_freq.device.type == "cpu"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int) -> torch.Tensor:
    """x [T, H, D] with its first r dims rotated as adjacent pairs; cos, sin [T, 1, r/2] float32.
    Computed in float32, as HF's complex-number form."""
    pairs = x[..., :r].float().unflatten(-1, (r // 2, 2))  # [T, H, r/2, 2]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rot = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2).to(x.dtype)  # [T, H, r]
    return rot if r == x.shape[-1] else torch.cat((rot, x[..., r:]), dim=-1)
