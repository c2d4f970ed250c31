"""Looped MoE (`loop-moe`): Foil ("How to loop a MoE?") and the seedvar loop-lm
architecture it ports (arXiv 2605.09165). The public reference is
`src/model/modeling_loop_lm.py` of SR-A-W/how-to-loop-moe-iclr27-submission; its numerics
are followed, its Python is never executed.

Layout (`LoopConfig`):

    head layers (run once) -> stack of L layers, run R times -> tail layers (run once)
    -> gain-free RMSNorm -> lm_head

Each layer is x + attn(norm(x)), then h + moe(norm(h)), with muP's conventions: RMSNorm
without a gain (eps 1e-5, float32), attention scaled by 1 / d_k (not 1 / sqrt(d_k)),
multi-head attention (no GQA) without biases, RoPE on adjacent pairs (x0, x1), (x2, x3)
with angles pos / theta^(2j / d_k) computed in float64 and cast, a float32 softmax router
whose top-k is renormalised, SwiGLU experts of width d_ff // num_active. Head and tail
layers have 8 experts (the reference's `HEAD_TAIL_NUM_EXPERTS`); the stack has
`num_experts`.

In moestream the R passes are unrolled: decoder layer u of head + L * R + tail has its own
KV cache (the reference has no cache: its docstring says one would be keyed by (layer,
pass)). Stack layer l's router and experts are one module shared by its R decoder layers,
so they are held once and its experts are keyed by the decoder index of its first pass
(`ModelConfig.moe_layers`); its attention is shared too, or one per pass with
`per_pass_attention` (Foil's untied attention). Head and tail experts are few and run once
per token: they are resident dense weights (`OuterMoE`), not paged.

Checkpoint names: `model.token_embeddings`, `model.{head,tail}_layers.{i}.*`,
`model.stack.layers.{l}.attn.*` (or `attn.{pass}.*`), `router.gate`, `experts_w1/w3/w2`
([E, in, out]), `model.lm_head`; the norms have no tensors.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moestream.config import LoopConfig, ModelConfig
from moestream.experts.interface import ExpertStore
from moestream.layers.attention import Attention
from moestream.layers.attention_backend import AttentionBackend, AttentionMetadata
from moestream.layers.linear import Embedding, Linear
from moestream.layers.moe import SparseMoE
from moestream.layers.recurrent_state import StateMetadata
from moestream.layers.router import TopKRouter
from moestream.models.config_fields import HFConfigFields
from moestream.models.moe_decoder import MoEForCausalLM

# Experts of a head or tail layer, fixed by the architecture (the reference's HEAD_TAIL_NUM_EXPERTS).
OUTER_NUM_EXPERTS = 8
NORM_EPS = 1e-5
# ModelConfig's names -> loop-moe's config.json keys
ALIASES = {"hidden_size": "d_model", "num_attention_heads": "num_heads", "num_experts_per_tok": "num_active",
           "max_position_embeddings": "context_length"}


def gain_free_rms_norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x^2) + 1e-5) over the last dim, in float32; x [..., D] -> same shape and dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + NORM_EPS)).to(x.dtype)


class PairRotary(nn.Module):
    """RoPE on adjacent pairs as the reference's `RotaryPositionalEmbedding`: pair j of a head
    is rotated by pos / theta^(2j / d_k), the angle and its cos / sin computed in float64
    and cast to float32, then applied in the activations' dtype.

    forward(positions [T] int64, q [T, Hq, D], k [T, Hk, D]) -> (q, k) rotated, same dtypes.
    """

    def __init__(self, theta: float, head_dim: int) -> None:
        super().__init__()
        self.theta, self.head_dim = theta, head_dim

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        pairs = x.unflatten(-1, (self.head_dim // 2, 2))  # [T, H, D/2, 2]
        x0, x1 = pairs[..., 0], pairs[..., 1]
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        return torch.stack((c * x0 - s * x1, s * x0 + c * x1), dim=-1).flatten(-2)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        j = torch.arange(self.head_dim // 2, device=positions.device, dtype=torch.float64)
        angles = positions.double()[:, None] / self.theta ** (2 * j / self.head_dim)  # [T, D/2] float64
        cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]  # [T, 1, D/2]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


class OuterMoE(nn.Module):
    """A head or tail layer's MoE: float32-softmax top-k router (renormalised) over
    `num_experts` SwiGLU experts stored as the checkpoint holds them, x @ W:
    experts_w1, experts_w3 [E, H, I], experts_w2 [E, I, H]. Resident, computed here.

    forward(x [T, H]) -> [T, H], same dtype.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, True)
        self.experts_w1 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self.experts_w3 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self.experts_w2 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, k] float32, [T, k] int64
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            h = x[rows]
            y = (F.silu(h @ self.experts_w1[e]) * (h @ self.experts_w3[e])) @ self.experts_w2[e]  # [n, H]
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out


class LoopBlock(nn.Module):
    """One unrolled decoder layer: x + attn(norm(x)), then h + mlp(norm(h)), the norms
    gain-free. `self_attn` and `mlp` may be shared with the other passes of a stack layer.
    x [T, H] -> [T, H]."""

    is_linear = False
    has_kv_cache = True

    def __init__(self, attn: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, state_meta: StateMetadata | None) -> torch.Tensor:
        x = x + self.self_attn(positions, gain_free_rms_norm(x), cache, meta)
        return x + self.mlp(gain_free_rms_norm(x))


class LoopedDecoder(nn.Module):
    """embed_tokens, the unrolled `layers` (head, R passes of the stack, tail; shared modules
    appear once per pass) and the final gain-free `norm`."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, store: ExpertStore) -> None:
        super().__init__()
        loop = cfg.loop
        assert loop is not None
        rotary = PairRotary(cfg.rope.theta, cfg.head_dim)
        H, k, inter = cfg.hidden_size, cfg.num_experts_per_tok, cfg.moe_intermediate_size

        def attention() -> Attention:
            return Attention(H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, False, None, rotary, backend, None,
                             scale=cfg.attention_multiplier)

        def outer() -> LoopBlock:
            return LoopBlock(attention(), OuterMoE(H, loop.outer_num_experts, k, inter))

        self.embed_tokens = Embedding(cfg.vocab_size, H)
        h, L = loop.num_head_layers, loop.num_layers_in_stack
        moes = [SparseMoE(H, cfg.num_experts, k, True, h + l, store, intermediate_size=inter) for l in range(L)]
        attns = [[attention() for _ in range(loop.num_stacks if loop.per_pass_attention else 1)] for _ in range(L)]
        layers = [outer() for _ in range(h)]
        for r in range(loop.num_stacks):
            layers += [LoopBlock(attns[l][r if loop.per_pass_attention else 0], moes[l]) for l in range(L)]
        layers += [outer() for _ in range(loop.num_tail_layers)]
        self.layers = nn.ModuleList(layers)
        order = [m for _ in range(loop.num_stacks) for m in moes]  # the stack's MoE layers in the order they run
        for moe, nxt in zip(order, order[1:]):
            moe.set_lookahead(nxt.layer_idx, nxt.gate)

    @staticmethod
    def norm(x: torch.Tensor) -> torch.Tensor:
        return gain_free_rms_norm(x)


class LoopMoEForCausalLM(MoEForCausalLM):
    """Looped MoE; see the module docstring. `forward` and `compute_logits` are the base
    class's over the unrolled layers."""

    display_name = "loop-moe"

    @classmethod
    def decoder_fields(cls, f: HFConfigFields) -> tuple[HFConfigFields, dict[str, Any]]:
        """loop-moe's config.json under ModelConfig's names (errors name loop-moe's keys): the
        unrolled depth as `num_hidden_layers`, one KV head per head, no tied embeddings."""
        for key in ("num_layers_in_stack", "num_stacks", "num_experts", "num_active", "d_model", "num_heads", "d_ff",
                    "rope_theta", "context_length", "vocab_size"):
            if f.hf.get(key) is None:
                raise f.error(key, "is missing; a loop-moe config states it (the reference gives it no default)")
        loop = LoopConfig(
            num_head_layers=f.integer("num_head_layers", default=0, minimum=0),
            num_layers_in_stack=f.integer("num_layers_in_stack", minimum=1),
            num_stacks=f.integer("num_stacks", minimum=1),
            num_tail_layers=f.integer("num_tail_layers", default=0, minimum=0),
            per_pass_attention=f.flag("per_pass_attention", default=False),
            outer_num_experts=OUTER_NUM_EXPERTS,
        )
        hf = {k: v for k, v in f.hf.items() if k not in ("num_hidden_layers", "num_key_value_heads", "head_dim",
                                                          "tie_word_embeddings", "rms_norm_eps", "hidden_act")}
        for ours, theirs in ALIASES.items():
            hf[ours] = f.hf[theirs]
        hf["num_hidden_layers"] = loop.unrolled_depth
        fields = HFConfigFields(hf, f.where, f.model_name, f.prefix, {**f.names, **ALIASES})
        return fields, {"loop": loop, "rms_norm_eps": NORM_EPS, "tie_word_embeddings": False}

    @classmethod
    def config_fields(cls, f: HFConfigFields, common: dict[str, Any]) -> dict[str, Any]:
        loop: LoopConfig = common["loop"]
        hidden, heads, k = common["hidden_size"], common["num_heads"], common["num_experts_per_tok"]
        if hidden % heads or (hidden // heads) % 2:
            raise f.error("num_attention_heads", f"is {heads}; it must divide d_model {hidden} into heads of an even "
                                                 "dimension (RoPE rotates pairs)")
        d_ff, num_experts = f.integer("d_ff", minimum=1), f.integer("num_experts", minimum=1)
        if d_ff % k:
            raise f.error("num_experts_per_tok", f"is {k}; it must divide d_ff {d_ff} (expert width d_ff // num_active)")
        if loop.num_head_layers + loop.num_tail_layers and k > OUTER_NUM_EXPERTS:  # the stack's: _check_model_fields
            raise f.error("num_experts_per_tok", f"is {k}, more than the {OUTER_NUM_EXPERTS} experts of a head or "
                                                 "tail layer")
        h, L = loop.num_head_layers, loop.num_layers_in_stack
        return dict(
            num_kv_heads=heads,
            head_dim=hidden // heads,
            num_experts=num_experts,
            moe_layers=tuple(h <= u < h + L for u in range(loop.unrolled_depth)),
            moe_intermediate_size=d_ff // k,
            intermediate_size=d_ff // k,
            norm_topk_prob=True,
            qk_norm=False,
            attention_bias=False,
            o_proj_bias=False,
            attention_multiplier=1.0 / (hidden // heads),
        )

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, store: ExpertStore, device: torch.device) -> None:
        nn.Module.__init__(self)
        if cfg.quantization is not None:
            raise ValueError("quantized loop-moe checkpoints are not supported; use a float checkpoint")
        self.config = cfg
        self.model = LoopedDecoder(cfg, backend, store)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @classmethod
    def split_expert_tensors(cls, cfg: ModelConfig, layer: int) -> tuple[str, str, str] | None:
        assert cfg.loop is not None
        block, _, l = cfg.loop.locate(layer)
        base = f"model.stack.layers.{l}" if block == "stack" else f"model.{block}_layers.{l}"
        return f"{base}.experts_w1", f"{base}.experts_w3", f"{base}.experts_w2"

    def hf_name(self, name: str) -> str:
        """Our parameter name -> the reference's checkpoint name."""
        if name == "lm_head.weight":
            return "model.lm_head.weight"
        if name == "model.embed_tokens.weight":
            return "model.token_embeddings.weight"
        m = re.fullmatch(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(.+)", name)
        if m is None:
            return name
        loop = self.config.loop
        assert loop is not None
        block, r, i = loop.locate(int(m.group(1)))
        base = f"model.stack.layers.{i}" if block == "stack" else f"model.{block}_layers.{i}"
        rest = m.group(3)
        if m.group(2) == "self_attn":
            rest = rest.replace("o_proj.", "output_proj.")
            per_pass = block == "stack" and loop.per_pass_attention
            return f"{base}.attn.{r}.{rest}" if per_pass else f"{base}.attn.{rest}"
        return f"{base}.router.gate.weight" if rest == "gate.weight" else f"{base}.{rest}"

    def set_row_tile(self, row_tile: int) -> None:
        if row_tile:
            raise ValueError("batch_invariant is not supported for loop-moe (its head and tail experts are not "
                             "covered); turn batch_invariant off")
        super().set_row_tile(row_tile)
