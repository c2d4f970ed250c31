"""Build tiny random-weight HF checkpoints (Qwen3-MoE, Mixtral) with a real tokenizer.

Used by the test fixtures, and runnable: `python tests/tiny_checkpoint.py OUT_DIR [--model-type mixtral]`.
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tokenizers")
TOKENIZERS = {"qwen3_moe": "qwen2", "mixtral": "mistral_v1"}


def make_tiny_checkpoint(out_dir: str, model_type: str = "qwen3_moe", seed: int = 0, **overrides: object) -> str:
    """Write a tiny random checkpoint (config.json, model.safetensors, tokenizer) to `out_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok_dir = os.path.join(FIXTURES, TOKENIZERS[model_type])
    common = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=False)
    if model_type == "qwen3_moe":
        kw = dict(vocab_size=151936, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2, head_dim=16, norm_topk_prob=True, mlp_only_layers=[1],
                  eos_token_id=151643, bos_token_id=151643)
    else:
        kw = dict(vocab_size=32000, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                  eos_token_id=2, bos_token_id=1)
    cfg = AutoConfig.for_model(model_type, **{**common, **kw, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Larger-than-default init so that routing and logits are far from uniform (fewer numerical ties).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out_dir)
    for f in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, f), out_dir)
    return out_dir


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_dir")
    ap.add_argument("--model-type", default="qwen3_moe", choices=sorted(TOKENIZERS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(make_tiny_checkpoint(args.out_dir, args.model_type, args.seed))
