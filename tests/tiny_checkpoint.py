"""Build tiny random-weight HF checkpoints (Qwen3-MoE, Mixtral, Qwen3-Next, Qwen3.5-MoE,
DeepSeek-V2, DeepSeek-V3, GLM-4.5, gpt-oss, Granite-4.0-H, Nemotron-H, Kimi-Linear; and loop-moe, written
directly in its reference's layout) with a real tokenizer.

Used by the test fixtures, and runnable: `python tests/tiny_checkpoint.py OUT_DIR [--model-type qwen3_next]`.
Qwen3.5-MoE comes as the text-only class (`qwen3_5_moe`, model_type qwen3_5_moe_text) or the
multimodal one (`qwen3_5_moe_vl`, model_type qwen3_5_moe, with a tiny vision tower).
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tokenizers")
TOKENIZERS = {
    "qwen3_moe": "qwen2", "mixtral": "mistral_v1", "qwen3_next": "qwen2", "qwen3_5_moe": "qwen2", "qwen3_5_moe_vl": "qwen2",
    "deepseek_v2": "qwen2", "deepseek_v3": "qwen2", "glm4_moe": "qwen2", "gpt_oss": "qwen2",
    "granitemoehybrid": "qwen2", "nemotron_h": "qwen2", "kimi_linear": "qwen2",
}
_QWEN2_VOCAB = dict(vocab_size=151936, eos_token_id=151643, bos_token_id=151643)
# MLA fixtures: 4 heads of 16 (nope) + 8 (rope) query/key dims, 16 value dims, a latent of 32;
# V2 without a q LoRA (as V2-Lite), V3 with one and a yarn rope whose mscale changes the softmax scale.
# Layer 0 is dense (first_k_dense_replace), layers 1-2 are MoE with one shared expert.
DEEPSEEK = dict(
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
    moe_intermediate_size=32, intermediate_size=96, first_k_dense_replace=1, num_experts_per_tok=2,
    num_key_value_heads=4, **_QWEN2_VOCAB,
)
DEEPSEEK_V2 = dict(DEEPSEEK, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.5)
DEEPSEEK_V3 = dict(DEEPSEEK, q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                   rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                        original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=1.0,
                                        beta_fast=32, beta_slow=1))
# GLM-4.5: q/k/v bias, q/k norm, rotary on half of each 16-dim head, 4 groups of 2 experts (top 2 groups).
GLM4_MOE = dict(
    head_dim=16, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32, intermediate_size=96,
    first_k_dense_replace=1, use_qk_norm=True, attention_bias=True, n_group=4, topk_group=2, num_experts_per_tok=2,
    routed_scaling_factor=1.8, **_QWEN2_VOCAB,
)
# gpt-oss: 4 layers alternating sliding (a window of 16 tokens) and full attention, sinks, biased
# router and experts, YaRN (transformers' default rope for gpt_oss), 8 experts of 32, top-2.
GPT_OSS = dict(
    head_dim=16, num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
    sliding_window=16, swiglu_limit=1.0, **_QWEN2_VOCAB,
)
# Granite-4.0-H: Mamba-2 layers around one attention layer (no RoPE), 8 experts top-2 and a
# shared MLP in every layer; 4 SSM heads of 32 in 2 groups; every multiplier away from 1.
GRANITE = dict(
    num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"], intermediate_size=24,
    shared_intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=32,
    mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
    embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=3.0, **_QWEN2_VOCAB,
)
# Nemotron-H: one block per layer: Mamba-2, MoE, attention (no RoPE) next to a Mamba-2 block, MoE,
# dense relu^2 MLP; sigmoid routing with a correction bias over 8 ungated relu^2 experts (top-2,
# scaled by 2.5) plus a shared one; 4 SSM heads of 32 in 2 groups.
NEMOTRON_H = dict(
    layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "moe", "mlp"],
    head_dim=16, intermediate_size=48, moe_intermediate_size=24, moe_shared_expert_intermediate_size=40,
    n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5,
    mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16,
    **_QWEN2_VOCAB,
)
# Kimi-Linear: KDA, MLA (no RoPE, no q LoRA), KDA, KDA; layer 0 a dense MLP, the others MoE
# (sigmoid routing with a correction bias, 4 groups of 2 experts, top-2, one shared expert);
# 4 KDA heads of 16.
KIMI_LINEAR = dict(
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, intermediate_size=96, moe_intermediate_size=32,
    num_local_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_head_dim=16, linear_num_heads=4,
    linear_conv_kernel_dim=4, pad_token_id=0, **_QWEN2_VOCAB,
)
_PRESETS = {"deepseek_v2": DEEPSEEK_V2, "deepseek_v3": DEEPSEEK_V3, "glm4_moe": GLM4_MOE, "gpt_oss": GPT_OSS,
            "granitemoehybrid": GRANITE, "nemotron_h": NEMOTRON_H, "kimi_linear": KIMI_LINEAR}
# Hybrid fixtures: 3 Gated DeltaNet layers + 1 gated full-attention layer, 2 key / 4 value heads.
HYBRID = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
    num_experts_per_tok=2, max_position_embeddings=512, vocab_size=151936, eos_token_id=151643,
    bos_token_id=151643, tie_word_embeddings=False,
)


# The multimodal fixture's vision tokens, added to the Qwen2 tokenizer after its 151936 entries.
VL_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VL_TOKENS = dict(vision_start_token_id=151936, vision_end_token_id=151937, image_token_id=151938,
                 video_token_id=151939)
VL_VOCAB_SIZE = 151952
# Qwen3.5's image preprocessing, scaled to the tiny tower (8-pixel patches, 2 x 2 merge): Qwen2-VL's
# image processor fields, as in a hub checkpoint's preprocessor_config.json.
VL_PREPROCESSOR = dict(
    image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen3VLProcessor", patch_size=8, merge_size=2,
    temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64},
)
# Qwen3-VL's video preprocessing scaled the same way (video_preprocessor_config.json).
VL_VIDEO_PREPROCESSOR = dict(
    video_processor_type="Qwen3VLVideoProcessor", patch_size=8, merge_size=2, temporal_patch_size=2,
    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], size={"shortest_edge": 2 * 16 * 16, "longest_edge": 4 * 48 * 48},
)
# Qwen-VL's chat template shape: image and video content parts become vision placeholders.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _hybrid_model(model_type: str, overrides: dict) -> "torch.nn.Module":
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen3_5_moe import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
    )

    kw = {**HYBRID, **overrides}
    if model_type == "qwen3_next":
        cfg = AutoConfig.for_model("qwen3_next", intermediate_size=96, mlp_only_layers=[1], **kw)
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if model_type == "qwen3_5_moe":
        return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**kw))
    # M-RoPE over all 16 dims of a head (8 frequencies: T at 0, 3, 6; H at 1, 4, 7; W at 2, 5).
    kw.update(vocab_size=VL_VOCAB_SIZE, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0, mrope_section=[3, 3, 2],
        mrope_interleaved=True))
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
                  num_position_embeddings=64)
    return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=kw, vision_config=vision, **VL_TOKENS))


def make_tiny_checkpoint(out_dir: str, model_type: str = "qwen3_moe", seed: int = 0, **overrides: object) -> str:
    """Write a tiny random checkpoint (config.json, model.safetensors, tokenizer) to `out_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok_dir = os.path.join(FIXTURES, TOKENIZERS[model_type])
    common = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=False)
    if model_type in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_vl"):
        torch.manual_seed(seed)
        model = _hybrid_model(model_type, overrides)
        _randomize(model)
        model.save_pretrained(out_dir)
        _copy_tokenizer(tok_dir, out_dir)
        if model_type == "qwen3_5_moe_vl":
            _add_vision_tokens(out_dir)
        return out_dir
    if model_type in _PRESETS:
        kw = dict(_PRESETS[model_type])
    elif model_type == "qwen3_moe":
        kw = dict(vocab_size=151936, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2, head_dim=16, norm_topk_prob=True, mlp_only_layers=[1],
                  eos_token_id=151643, bos_token_id=151643)
    else:
        kw = dict(vocab_size=32000, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                  eos_token_id=2, bos_token_id=1)
    cfg = AutoConfig.for_model(model_type, **{**common, **kw, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, biases=model_type == "gpt_oss")
    if model_type in ("granitemoehybrid", "nemotron_h", "kimi_linear"):
        _randomize_mamba(model)
    model.save_pretrained(out_dir)
    _copy_tokenizer(tok_dir, out_dir)
    return out_dir


# A tiny loop-moe (Foil): 1 head layer, a stack of 2 layers run 3 times, 1 tail layer (8 unrolled
# layers); 16 experts in the stack, 8 (the architecture's fixed count) in the head and tail.
LOOP_MOE = dict(vocab_size=32000, context_length=512, d_model=64, num_heads=4, d_ff=64, rope_theta=10000.0,
                width_ratio=0.5, num_layers_in_stack=2, num_stacks=3, num_experts=16, num_active=2,
                lb_loss_factor=0.01, lz_loss_factor=0.001, num_head_layers=1, num_tail_layers=1,
                per_pass_attention=True, eos_token_id=2, bos_token_id=1)


def make_loop_moe_checkpoint(out_dir: str, seed: int = 0, **overrides: object) -> str:
    """Write a tiny random loop-moe checkpoint in the reference's layout (config.json with
    `model_type` "loop-moe", model.safetensors with its tensor names and [E, in, out] experts,
    each attention's persistent `rope.rotations` table) and the Mistral tokenizer.
    transformers has no loop-moe class, so the tensors are written directly."""
    import json

    from safetensors.torch import save_file

    cfg = {**LOOP_MOE, **overrides, "model_type": "loop-moe", "architectures": ["LoopMoEForCausalLM"]}
    d, heads, k = cfg["d_model"], cfg["num_heads"], cfg["num_active"]
    d_k, inter = d // heads, cfg["d_ff"] // k
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    # the reference's table: [context_length, d_k/2, 2, 2] rows [[cos, -sin], [sin, cos]], angles in float64
    pos = torch.arange(cfg["context_length"], dtype=torch.float64)[:, None]
    ang = pos / cfg["rope_theta"] ** (2 * torch.arange(d_k // 2, dtype=torch.float64) / d_k)
    rot = torch.stack([torch.stack([ang.cos(), -ang.sin()], -1), torch.stack([ang.sin(), ang.cos()], -1)], -2).float()
    t: dict[str, torch.Tensor] = {"model.token_embeddings.weight": randn(cfg["vocab_size"], d, std=1.0),
                                  "model.lm_head.weight": randn(cfg["vocab_size"], d)}

    def attention(prefix: str) -> None:
        for n in ("q_proj", "k_proj", "v_proj", "output_proj"):
            t[f"{prefix}.{n}.weight"] = randn(d, d)
        t[f"{prefix}.rope.rotations"] = rot.clone()

    def moe(prefix: str, num: int) -> None:
        t[f"{prefix}.router.gate.weight"] = randn(num, d, std=0.3)
        t[f"{prefix}.experts_w1"], t[f"{prefix}.experts_w3"] = randn(num, d, inter), randn(num, d, inter)
        t[f"{prefix}.experts_w2"] = randn(num, inter, d)

    for block, count in (("head", cfg["num_head_layers"]), ("tail", cfg["num_tail_layers"])):
        for i in range(count):
            attention(f"model.{block}_layers.{i}.attn")
            moe(f"model.{block}_layers.{i}", 8)
    for l in range(cfg["num_layers_in_stack"]):
        if cfg["per_pass_attention"]:
            for r in range(cfg["num_stacks"]):
                attention(f"model.stack.layers.{l}.attn.{r}")
        else:
            attention(f"model.stack.layers.{l}.attn")
        moe(f"model.stack.layers.{l}", cfg["num_experts"])
    os.makedirs(out_dir, exist_ok=True)
    save_file(t, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    _copy_tokenizer(os.path.join(FIXTURES, "mistral_v1"), out_dir)
    return out_dir


def _randomize(model: torch.nn.Module, biases: bool = False) -> None:
    """Larger-than-default init so that routing and logits are far from uniform (fewer numerical
    ties); norm weights are perturbed too, so that a zero-centred norm's offset matters.
    `biases`: every bias and attention sink is drawn too (gpt-oss: so that each one matters)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or (biases and (name.endswith("bias") or name.endswith("sinks"))):
                p.normal_(0.0, 0.08 if p.dim() >= 2 else 0.5 if name.endswith("sinks") else 0.02)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3 / GLM: selection differs from weights
                b.normal_(0.0, 0.1)


def _randomize_mamba(model: torch.nn.Module) -> None:
    """Mamba-2 (and KDA) parameters away from their init: decay rates A in [0.5, 4.5), D and
    dt_bias drawn, conv biases drawn, so that each of them matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand_like(p) * 4 + 0.5))
            elif name.endswith(".D") or name.endswith("conv1d.bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)


def _copy_tokenizer(tok_dir: str, out_dir: str) -> None:
    for f in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, f), out_dir)


def _add_vision_tokens(out_dir: str) -> None:
    """The multimodal fixture's tokenizer (vision tokens added), chat template and preprocessor configs."""
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    tok.add_special_tokens({"additional_special_tokens": list(VL_SPECIAL_TOKENS)})
    assert [tok.convert_tokens_to_ids(t) for t in VL_SPECIAL_TOKENS] == list(VL_TOKENS.values())
    tok.chat_template = VL_CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump(VL_PREPROCESSOR, f, indent=2)
    with open(os.path.join(out_dir, "video_preprocessor_config.json"), "w") as f:
        json.dump(VL_VIDEO_PREPROCESSOR, f, indent=2)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_dir")
    ap.add_argument("--model-type", default="qwen3_moe", choices=sorted(TOKENIZERS) + ["loop-moe"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.model_type == "loop-moe":
        print(make_loop_moe_checkpoint(args.out_dir, args.seed))
    else:
        print(make_tiny_checkpoint(args.out_dir, args.model_type, args.seed))
