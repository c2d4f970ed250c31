"""Deterministic random-weight MoE checkpoints in Hugging Face format, for benchmarks.

Presets (all with the real Qwen2 tokenizer, `tests/fixtures/tokenizers/qwen2`):

- `small`: Qwen3-MoE, hidden 512, 8 layers, 32 experts, top-4 (~0.2 GiB of experts);
- `medium`: Qwen3-MoE, hidden 1024, 16 layers, 64 experts, top-8, moe_intermediate 512
  (~3.0 GiB of experts in bf16);
- `hybrid-medium`: Qwen3-Next at the same scale (Gated DeltaNet with head dim 128, one
  gated full-attention layer in four, a shared expert);
- `hybrid-mamba2`: Nemotron-H at the same scale (16 blocks "MEMEM*EMEMEM*EME": 7 Mamba-2
  with 32 heads of 64 and 8 groups of a 128 state, 7 MoE of 64 ungated relu^2 experts of 512
  with a shared one, 2 GQA attention layers without RoPE);
- `dsv2lite`: DeepSeek-V2-Lite shapes (~30 GiB; built only when named). Its vocabulary is
  the Qwen2 tokenizer's (151936), not DeepSeek's 102400, since no DeepSeek tokenizer ships here.
- `dsv2lite-14`: DeepSeek-V2-Lite's shapes in 14 layers (~15 GiB, 13.4 GiB of routed experts)
  with a 1536-rank query LoRA as DeepSeek-V2 and V3 have (llama.cpp takes a DeepSeek-V2
  without one only at Lite's 26 or 27 layers): the offload headline's model
  (`bench/offload_headline.py`); built only when named.
- `dsv2-small`: DeepSeek-V2 at `small`'s scale with the real MLA dims (kv_lora_rank 512 +
  qk_rope_head_dim 64 = 576, which vLLM's CPU MLA needs; 128 + 64 query/key and 128 value
  dims per head), 2 shared experts, layer 0 dense;
- `glm45-small`: GLM-4.5 at `small`'s scale (q/k/v bias, q/k norm, rotary on half of each
  128-dim head, sigmoid routing with a correction bias, one shared expert, layer 0 dense).
- `gpt-oss-small`: gpt-oss at `small`'s scale (8 layers alternating a 128-token sliding
  window and full attention, sinks, 32 experts of 256, top-4, YaRN), experts fused as
  transformers stores gpt-oss (`gate_up_proj` [E, H, 2I]);
- `tiny`: a few MiB, for the smoke tests.

The state dict is written tensor by tensor in bf16 (never a whole fp32 model in memory):
tensor names and shapes come from the transformers model built on the meta device, with
fused expert tensors written per expert as HF checkpoints store them. Each tensor's values
come from its own generator seeded by (seed, name), so a checkpoint is the same whatever the
shard size. Writes config.json (transformers' `AutoConfig.for_model(...)`), safetensors shards
with an index, and the tokenizer files.

    python bench/make_checkpoint.py small /tmp/moestream-bench/small
    python bench/make_checkpoint.py dsv2lite /big/disk/dsv2lite
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import zlib
from collections.abc import Iterator

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "tokenizers", "qwen2")
QWEN2_VOCAB = 151936
QWEN2_EOS = 151643

_QWEN3_MOE = dict(vocab_size=QWEN2_VOCAB, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
                  eos_token_id=QWEN2_EOS, bos_token_id=QWEN2_EOS, rope_theta=1000000.0)
PRESETS: dict[str, tuple[str, dict]] = {
    "tiny": ("qwen3_moe", dict(_QWEN3_MOE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               num_experts=8, num_experts_per_tok=2)),
    "small": ("qwen3_moe", dict(_QWEN3_MOE, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                                num_hidden_layers=8, num_experts=32, num_experts_per_tok=4)),
    "medium": ("qwen3_moe", dict(_QWEN3_MOE, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                                 num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                 num_experts=64, num_experts_per_tok=8)),
    "hybrid-medium": ("qwen3_next", dict(
        vocab_size=QWEN2_VOCAB, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_hidden_layers=16, full_attention_interval=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=8,
        linear_num_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=QWEN2_EOS, bos_token_id=QWEN2_EOS,
        rope_theta=10000000.0)),
    "hybrid-mamba2": ("nemotron_h", dict(
        vocab_size=QWEN2_VOCAB, hidden_size=1024, hybrid_override_pattern="MEMEM*EMEMEM*EME",
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, intermediate_size=2048, moe_intermediate_size=512,
        moe_shared_expert_intermediate_size=1024, n_routed_experts=64, num_experts_per_tok=8, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, mamba_num_heads=32, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
        conv_kernel=4, chunk_size=128, max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=QWEN2_EOS, bos_token_id=QWEN2_EOS)),
    "dsv2lite": ("deepseek_v2", dict(
        vocab_size=QWEN2_VOCAB, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
        n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=QWEN2_EOS, bos_token_id=QWEN2_EOS,
        rope_theta=10000.0)),
    "dsv2lite-14": ("deepseek_v2", dict(
        vocab_size=QWEN2_VOCAB, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=14, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
        n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1,
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=QWEN2_EOS, bos_token_id=QWEN2_EOS,
        rope_theta=10000.0)),
    "dsv2-small": ("deepseek_v2", dict(
        vocab_size=QWEN2_VOCAB, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, n_shared_experts=2,
        n_routed_experts=32, num_experts_per_tok=4, first_k_dense_replace=1, moe_layer_freq=1,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=QWEN2_EOS, bos_token_id=QWEN2_EOS,
        rope_theta=10000.0)),
    "glm45-small": ("glm4_moe", dict(
        vocab_size=QWEN2_VOCAB, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=128, partial_rotary_factor=0.5,
        use_qk_norm=True, attention_bias=True, n_shared_experts=1, n_routed_experts=32, num_experts_per_tok=4,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=QWEN2_EOS, bos_token_id=QWEN2_EOS,
        rope_theta=1000000.0)),
    "gpt-oss-small": ("gpt_oss", dict(
        vocab_size=QWEN2_VOCAB, hidden_size=512, intermediate_size=256, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=QWEN2_EOS, bos_token_id=QWEN2_EOS)),
}


def make_config(preset: str, **overrides: object):  # -> transformers.PretrainedConfig
    """The transformers config of a preset (overrides replace preset fields)."""
    from transformers import AutoConfig

    model_type, kw = PRESETS[preset]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = AutoConfig.for_model(model_type, **{**kw, **overrides})
    cfg.dtype = torch.bfloat16
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]  # vLLM picks its model class by this
    return cfg


def tensor_specs(cfg) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor, in the HF checkpoint layout: the meta-device
    model's state dict, with fused `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj`
    [E, H, I] split into `experts.{e}.{gate,up,down}_proj.weight` (gpt-oss keeps them fused,
    as its checkpoints do)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    for name, t in model.state_dict().items():
        shape = tuple(t.shape)
        if cfg.model_type == "nemotron_h":  # its checkpoints: "backbone.", experts per expert, ungated
            name = "backbone." + name[len("model."):] if name.startswith("model.") else name
            if name.endswith(("experts.up_proj", "experts.down_proj")):
                prefix, part = name.rsplit(".", 1)
                for e in range(shape[0]):
                    yield f"{prefix}.{e}.{part}.weight", shape[1:]
                continue
            yield name, shape
        elif cfg.model_type == "gpt_oss":
            yield name, shape
        elif name.endswith("experts.gate_up_proj"):
            prefix, inter = name[: -len("gate_up_proj")], shape[1] // 2
            for e in range(shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", (inter, shape[2])
                yield f"{prefix}{e}.up_proj.weight", (inter, shape[2])
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(shape[0]):
                yield f"{prefix}{e}.down_proj.weight", (shape[1], shape[2])
        else:
            yield name, shape


def make_tensor(name: str, shape: tuple[int, ...], seed: int, zero_centred_norms: bool = False,
                std: float = 0.02) -> torch.Tensor:
    """One bf16 tensor, a function of (seed, name, shape) only. Norm weights are 1 plus small
    noise (0 plus noise where the model's norms are zero-centred, i.e. scale by 1 + w), Gated
    DeltaNet's A_log is log(U(1, 16)) and dt_bias 1, other biases (linear layers', the router's
    e_score_correction_bias) N(0, 0.02), matrices N(0, std) (routers N(0, 4 std), so that
    routing is far from uniform)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1, 16, generator=g).log().to(torch.bfloat16)
    if name.endswith("dt_bias"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if len(shape) == 1 and name.endswith("bias"):  # linear biases, the router's e_score_correction_bias
        return (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    if len(shape) == 1:
        base = 0.0 if zero_centred_norms and not name.endswith("linear_attn.norm.weight") else 1.0
        return (base + 0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    scale = 4 * std if name.endswith(("mlp.gate.weight", "mlp.router.weight", "mixer.gate.weight")) else std
    out = torch.empty(shape, dtype=torch.bfloat16)
    flat, rows = out.view(shape[0], -1), 1 << 14
    for start in range(0, shape[0], rows):  # bounded fp32 scratch for the big embeddings
        n = min(rows, shape[0] - start)
        flat[start:start + n] = (torch.randn((n, flat.shape[1]), generator=g) * scale).to(torch.bfloat16)
    return out


def plan_shards(specs: list[tuple[str, tuple[int, ...]]], shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Split tensors, in order, into shards of at most `shard_bytes` (a bigger tensor gets its own)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def write_checkpoint(preset: str, out_dir: str, seed: int = 0, shard_bytes: int = 2 << 30,
                     **overrides: object) -> dict:
    """Write a preset's checkpoint to `out_dir` (config.json, shards + index, tokenizer).
    Returns a summary: total and routed-expert bytes, tensor and shard counts."""
    from safetensors.torch import save_file

    cfg = make_config(preset, **overrides)
    os.makedirs(out_dir, exist_ok=True)
    specs = list(tensor_specs(cfg))
    total = sum(2 * math.prod(s) for _, s in specs)
    expert_bytes = sum(2 * math.prod(s) for n, s in specs if ".experts." in n)
    zero_centred = cfg.model_type == "qwen3_next"
    shards = plan_shards(specs, shard_bytes)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        tensors = {name: make_tensor(name, shape, seed, zero_centred) for name, shape in shard}
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in tensors})
        print(f"  wrote {fname} ({sum(t.numel() * 2 for t in tensors.values()) / 2**30:.2f} GiB)", flush=True)
        del tensors
    if len(shards) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    cfg.save_pretrained(out_dir)
    _add_legacy_config_keys(os.path.join(out_dir, "config.json"))
    for f in os.listdir(TOKENIZER):
        shutil.copy(os.path.join(TOKENIZER, f), out_dir)
    summary = {"preset": preset, "model_type": cfg.model_type, "seed": seed, "total_bytes": total,
               "routed_expert_bytes": expert_bytes, "tensors": len(specs), "shards": len(shards)}
    with open(os.path.join(out_dir, "bench_checkpoint.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _add_legacy_config_keys(path: str) -> None:
    """Also write `rope_theta` / `partial_rotary_factor` / `torch_dtype` at the top level, as
    transformers 4.x (which the peers' venvs may hold) reads them there."""
    with open(path) as f:
        cfg = json.load(f)
    rope = cfg.get("rope_parameters") or {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in rope and key not in cfg:
            cfg[key] = rope[key]
    cfg.setdefault("torch_dtype", "bfloat16")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def ensure_checkpoint(preset: str, out_dir: str, seed: int = 0) -> str:
    """Make the checkpoint unless `out_dir` already holds this preset's; returns `out_dir`."""
    marker = os.path.join(out_dir, "bench_checkpoint.json")
    if os.path.exists(marker):
        with open(marker) as f:
            done = json.load(f)
        if done.get("preset") == preset and done.get("seed") == seed:
            return out_dir
    print(f"making checkpoint {preset!r} in {out_dir} ...", flush=True)
    write_checkpoint(preset, out_dir, seed)
    return out_dir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gib", type=float, default=2.0, help="largest shard, GiB")
    args = ap.parse_args()
    summary = write_checkpoint(args.preset, args.out_dir, args.seed, int(args.shard_gib * 2**30))
    print(json.dumps(summary))
    print(f"{args.preset}: {summary['total_bytes'] / 2**30:.2f} GiB, routed experts "
          f"{summary['routed_expert_bytes'] / 2**30:.2f} GiB in {summary['shards']} shard(s) -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
