"""A decoder-only MoE transformer (pre-norm; token mixer then MoE or dense MLP per layer),
and the base class of the model files.

A model file (`qwen3_moe.py`, `deepseek_v2.py`, ...) subclasses `MoEForCausalLM` and states
its parts, in the manner of mini-sglang's `models/` (a model file composes shared blocks):
- `config_fields`: how its HF config becomes a `ModelConfig` (the fields beyond the common ones);
- `make_attention`: its token mixer for layer i (GQA `Attention`, `MLAttention`, Gated DeltaNet);
- `make_mlp`: its MoE block (`SparseMoE` with its router and shared expert) or dense MLP;
- `expert_names` and `hf_name`: its checkpoint names. Parameter names equal HF's after `hf_name`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moestream.config import ModelConfig
from moestream.models.config_fields import HFConfigFields
from moestream.experts.interface import ExpertStore
from moestream.kernels.fused_moe import ACT_CODES
from moestream.models.decoder_layer_cpu import LayerPlan, decode_rows, layer_plan, run_layer
from moestream.layers.attention import Attention
from moestream.layers.attention_backend import AttentionBackend, AttentionMetadata
from moestream.layers.linear import Embedding, Linear
from moestream.layers.mlp import GatedMLP
from moestream.layers.moe import RoutingModifier, SparseMoE
from moestream.layers.norm import RMSNorm
from moestream.layers.recurrent_state import RecurrentMixer, StateMetadata
from moestream.layers.rotary import RotaryEmbedding
from moestream.layers.router import TopKRouter


class DecoderLayer(nn.Module):
    """x + mixer(norm(x)), then h + mlp(norm(h)); x [T, H] -> [T, H]. The mixer is attention
    (`self_attn`, over a paged KV cache) or a `RecurrentMixer` such as Gated DeltaNet
    (`linear_attn`, over state slots)."""

    def __init__(self, cfg: ModelConfig, mixer: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        offset = cfg.norm_unit_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.is_linear = isinstance(mixer, RecurrentMixer)
        self.has_kv_cache = not self.is_linear
        if self.is_linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.mlp = mlp
        self.residual_multiplier = cfg.residual_multiplier  # Granite scales each block's output

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        state_meta: StateMetadata | None,
    ) -> torch.Tensor:
        """cache: (k, v) for attention layers, the state tensors (`RecurrentMixer.state_specs`)
        for linear ones."""
        if self.is_linear:
            assert state_meta is not None, "a linear-attention layer needs state metadata"
            mixed = self.linear_attn(self.input_layernorm(x), cache, state_meta)
        else:
            mixed = self.self_attn(positions, self.input_layernorm(x), cache, meta)
        m = self.residual_multiplier
        x, h = self.post_attention_layernorm.forward_add(mixed if m == 1.0 else mixed * m, x)
        out = self.mlp(h)
        return x + (out if m == 1.0 else out * m)


class DecoderModel(nn.Module):
    def __init__(self, cls: type["MoEForCausalLM"], cfg: ModelConfig, backend: AttentionBackend, store: ExpertStore,
                 device: torch.device) -> None:
        super().__init__()
        rotary = cls.make_rotary(cfg, device)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(cls.make_layer(cfg, i, rotary, backend, store) for i in range(cfg.num_layers))
        moes = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
        for moe, nxt in zip(moes, moes[1:]):
            moe.set_lookahead(nxt.layer_idx, nxt.gate)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)


class MoEForCausalLM(nn.Module):
    """The whole model. Subclasses set `display_name`, `expert_names` and `config_fields`,
    and override the `make_*` parts that differ from the defaults (GQA attention, a
    softmax-routed `SparseMoE`, a dense SwiGLU MLP).

    forward(input_ids [T] int64, positions [T] int64 (or [3, T] M-RoPE positions), kv_caches:
            per full-attention layer (k, v), meta, state_caches: per linear-attention layer
            its state tensors (`recurrent_mixer.state_specs`), state_meta, resident_only: MoE layers route only to experts on the
            device, a draft pass; inputs_embeds [T, H]: the input embeddings to use instead of
            embedding input_ids, as multimodal prompts give)
        -> hidden states [T, H] (model dtype)
    compute_logits(hidden [N, H], out: a float32 [N, V] to write into, or None) -> [N, V] float32
    """

    # The model family's name in error messages ("Qwen3-MoE").
    display_name: str = ""
    # Decode-only steps through the C++ decode layer where it covers a layer (`set_cpu_decode_layer`).
    cpu_decode_layer: bool = False
    # Checkpoint names of expert e's (gate, up, down) weights in layer l, formatted with l and
    # e; the leading "model." stands for the config's `weight_prefix`.
    expert_names: tuple[str, str, str] = (
        "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
        "model.layers.{l}.mlp.experts.{e}.up_proj.weight",
        "model.layers.{l}.mlp.experts.{e}.down_proj.weight",
    )

    # The token mixer of the model's linear-attention layers (hybrid models; None for
    # others): its state tensors size the StatePool (`RecurrentMixer.state_specs`).
    recurrent_mixer: type[RecurrentMixer] | None = None

    # Names of a layer's fused 3-D expert tensors, when a checkpoint stores them instead of
    # per-expert ones: gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I] (the
    # default is transformers 5's in-memory layout, which some checkpoints store as is).
    fused_expert_names: tuple[str, str] = ("model.layers.{l}.mlp.experts.gate_up_proj",
                                           "model.layers.{l}.mlp.experts.down_proj")

    # The checkpoint stores fused 3-D experts as transformers 5 multiplies them, x @ W
    # (gpt-oss: gate_up_proj [E, H, 2I], down_proj [E, I, H]), not as [out, in] matrices.
    fused_experts_transposed: bool = False

    @classmethod
    def split_expert_tensors(cls, cfg: ModelConfig, layer: int) -> tuple[str, str, str] | None:
        """Checkpoint names of decoder layer `layer`'s experts when they are stored as three
        fused 3-D tensors multiplied x @ W: gate [E, H, I], up [E, H, I], down [E, I, H]
        (loop-moe's `experts_w1`, `experts_w3`, `experts_w2`); None for the other layouts."""
        return None

    # ---- configuration: HF config.json -> ModelConfig ------------------------------------

    @classmethod
    def decoder_fields(cls, f: HFConfigFields) -> tuple[HFConfigFields, dict[str, Any]]:
        """The fields the decoder's config is read from (a multimodal config nests them), and
        ModelConfig fields that come with them (e.g. `weight_prefix`, `multimodal`)."""
        return f, {}

    @classmethod
    def config_fields(cls, f: HFConfigFields, common: dict[str, Any]) -> dict[str, Any]:
        """ModelConfig fields of this model beyond the `common` ones `model_config_from_dict`
        read (at least num_experts, moe_layers, moe_intermediate_size, norm_topk_prob,
        qk_norm). Raises ValueError (see `HFConfigFields`)."""
        raise NotImplementedError

    # ---- the graph ------------------------------------------------------------------------

    @classmethod
    def make_rotary(cls, cfg: ModelConfig, device: torch.device) -> RotaryEmbedding:
        """The rotary embedding the attention layers share."""
        mm = cfg.multimodal
        return RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, device, cfg.partial_rotary_factor,
                               mm.mrope_section if mm is not None else None)

    @classmethod
    def make_attention(cls, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding,
                       backend: AttentionBackend) -> nn.Module:
        """Layer `idx`'s token mixer: GQA attention with the config's options."""
        return Attention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias,
            cfg.rms_norm_eps if cfg.qk_norm else None, rotary, backend, cfg.layer_window(idx),
            cfg.attn_output_gate, cfg.norm_unit_offset, cfg.o_proj_bias, cfg.attention_sinks,
        )

    @classmethod
    def make_mlp(cls, cfg: ModelConfig, idx: int, store: ExpertStore) -> nn.Module:
        """Layer `idx`'s MoE block, or its dense MLP when `cfg.moe_layers[idx]` is False."""
        if not cfg.moe_layers[idx]:
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        return SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, idx, store,
                         cfg.shared_expert_intermediate_size, cfg.shared_expert_gate, cfg.router,
                         cfg.expert_activation, cfg.moe_intermediate_size)

    @classmethod
    def make_layer(cls, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding, backend: AttentionBackend,
                   store: ExpertStore) -> DecoderLayer:
        return DecoderLayer(cfg, cls.make_attention(cfg, idx, rotary, backend), cls.make_mlp(cfg, idx, store))

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, store: ExpertStore, device: torch.device) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act '{cfg.hidden_act}'; only silu is supported")
        self.config = cfg
        self.model = DecoderModel(type(self), cfg, backend, store, device)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._plans: dict[torch.dtype, list[LayerPlan | None]] = {}  # per compute dtype, per layer

    def hf_name(self, name: str) -> str:
        """Checkpoint tensor name of our parameter `name` (the decoder's "model." becomes the
        config's `weight_prefix`)."""
        prefix = self.config.weight_prefix
        if prefix != "model." and name.startswith("model."):
            return prefix + name[len("model."):]
        return name

    def hf_names(self, name: str) -> tuple[str, ...]:
        """The checkpoint names our parameter `name` may be stored under, in order of
        preference (the loader reads the first the checkpoint has): `hf_name`'s alone, unless a
        model's checkpoints come in more than one layout."""
        return (self.hf_name(name),)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        state_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        state_meta: StateMetadata | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, H]
        if self.config.embedding_multiplier != 1.0:  # Granite
            x = x * self.config.embedding_multiplier
        kv_iter, state_iter = iter(kv_caches), iter(state_caches or ())
        plans = self._decode_plans(x) if x.device.type == "cpu" and decode_rows(meta, x.shape[0]) else None
        if plans is not None:  # a decode-only step: covered layers in one C++ call each (`decoder_layer_cpu`)
            rotary = next(layer.self_attn.rotary for layer, p in zip(self.model.layers, plans) if p is not None)
            cos, sin = rotary.cos_sin(positions, x.dtype) if rotary is not None else (x.new_empty(0),) * 2
        for i, layer in enumerate(self.model.layers):  # a state, a KV cache, or (Nemotron-H's MLP blocks) neither
            cache = next(state_iter) if layer.is_linear else next(kv_iter) if layer.has_kv_cache else None
            plan = plans[i] if plans is not None else None
            if plan is not None and x.shape[0] <= plan.max_rows:
                x = run_layer(plan, x, cache, cos, sin, meta)
            else:
                x = layer(positions, x, cache, meta, state_meta)
        return self.model.norm(x)

    def _decode_plans(self, x: torch.Tensor) -> list[LayerPlan | None] | None:
        """Each layer's C++ decode step for x's dtype (`decoder_layer_cpu.layer_plan`), made at the
        first decode step (after loading) and again when a setter below or the expert store's
        tensors change them; None when no layer is covered or `cpu_decode_layer` is off."""
        if not self.cpu_decode_layer:
            return None
        plans = self._plans.get(x.dtype)
        if plans is not None and all(p is None or p.gate_up_ptr == self._gate_up_ptr(layer)
                                     for p, layer in zip(plans, self.model.layers)):
            return plans if any(p is not None for p in plans) else None
        plans = [layer_plan(layer, x.dtype) if type(layer) is DecoderLayer else None for layer in self.model.layers]
        if len({id(layer.self_attn.rotary) for layer, p in zip(self.model.layers, plans) if p is not None}) > 1:
            plans = [None] * len(plans)  # the step's cos and sin are computed once, for one rotary embedding
        self._plans[x.dtype] = plans
        return plans if any(p is not None for p in plans) else None

    @staticmethod
    def _gate_up_ptr(layer: DecoderLayer) -> int:
        ex = layer.mlp.experts
        return ex.store.layer_weights(ex.layer_idx)[0].data_ptr()

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head.forward_float(hidden, out)
        return logits if self.config.logits_scaling == 1.0 else logits / self.config.logits_scaling

    def set_cpu_decode_layer(self, on: bool) -> None:
        """Run the decode-only steps of the layers it covers through the C++ decode layer
        (`decoder_layer_cpu.py`; the same output bit for bit), or never."""
        self.cpu_decode_layer = on
        self._plans = {}

    def set_fused_moe(self, fused: bool) -> None:
        """Run every routed-expert layer through the fused CPU kernel where it applies
        (`fused_applies` in layers/expert_executor.py; the kernel's activations, `ACT_CODES`),
        or never."""
        self._plans = {}
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.experts.fused = fused and module.experts.act.name in ACT_CODES

    def set_routing_modifier(self, modifier: RoutingModifier | None) -> None:
        """An approximate expert mode's routing modifier for every routed-expert layer, or None (exact)."""
        self._plans = {}
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.modifier = modifier

    def set_row_tile(self, row_tile: int) -> None:
        """Batch-invariant mode (`row_tile` > 0, `linear`'s row tiles) or the default (0), for
        every projection, router and expert executor of the model.

        Raises:
            ValueError: `row_tile` > 0 on a model whose layers are not all covered: MLA
                (its absorbed products) or linear attention (its recurrent kernels).
        """
        if row_tile and (self.config.mla is not None or self.config.is_hybrid):
            raise ValueError(f"batch_invariant is not supported for {self.display_name or self.config.model_type} "
                             "(multi-head latent attention and linear-attention layers are not covered); "
                             "turn batch_invariant off")
        self._plans = {}
        for module in self.modules():
            if isinstance(module, (Linear, TopKRouter)):
                module.row_tile = row_tile
            elif isinstance(module, SparseMoE):
                module.experts.row_tile = row_tile
