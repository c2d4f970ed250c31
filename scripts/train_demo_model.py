"""Train moestream's built-in demo models: a small Qwen3-MoE (default) or, with
`--arch qwen3_5_moe`, a small hybrid Qwen3.5-MoE with an MTP layer (scripts/train_demo_hybrid.py),
on the Python standard library.

Everything it needs is on any machine with Python: the text is the standard library's own
source and docstrings (`sysconfig.get_paths()["stdlib"]`), the tokenizer a byte-level BPE
trained here with `tokenizers`, the model transformers' `Qwen3MoeForCausalLM` trained with
its router load-balancing auxiliary loss. Files whose path hashes to 0 mod 20 are held out
for validation. Writes the checkpoint (bf16 safetensors, tokenizer, config,
training_metrics.json) to moestream/demo_model/ and the loss curve to docs/demo_model_loss.png.

    python scripts/train_demo_model.py [--minutes 40] [--out moestream/demo_model]
    python scripts/train_demo_model.py --arch qwen3_5_moe [--minutes 40]   # moestream/demo_hybrid_model
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sysconfig
import time

import numpy as np
import torch

from moestream.demo import is_heldout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOT = "<|endoftext|>"


def stdlib_files() -> list[str]:
    """The standard library's .py files (no site-packages), sorted for determinism."""
    base = sysconfig.get_paths()["stdlib"]
    out = []
    for root, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        out += [os.path.join(root, f) for f in sorted(files) if f.endswith(".py")]
    return out


def read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, bos_token=EOT, pad_token=EOT,
                                   clean_up_tokenization_spaces=False)


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    eot = tokenizer.convert_tokens_to_ids(EOT)
    ids: list[int] = []
    for enc in tokenizer._tokenizer.encode_batch(texts):
        ids += enc.ids + [eot]
    return np.asarray(ids, dtype=np.int32)


FIXED_TEXT = os.path.join(ROOT, "tests", "fixtures", "demo_heldout.txt")


def fixed_text_loss(out_dir: str, text_path: str = FIXED_TEXT) -> float:
    """HF float32 mean cross-entropy (nats/token) of the saved checkpoint on a fixed held-out
    text; the tests hold moestream's loss on the same text to this bound."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(open(text_path).read())])
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def routing_skew(out_dir: str, texts: list[str]) -> list[dict]:
    """Per MoE layer, max/mean expert load over the held-out `texts`, through moestream's
    own routing recorder (uniform routing would give ~1.0)."""
    import tempfile

    from moestream import LLM, SamplingParams
    from moestream.experts.trace import RoutingTrace

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "routing.npz")
        llm = LLM(out_dir, dtype="float32", max_model_len=2048, record_routing=path)
        tok = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": tok.encode(t)[:1024]} for t in texts]
        llm.generate([p for p in prompts if len(p["prompt_token_ids"]) > 1], SamplingParams(temperature=0, max_tokens=1))
        llm.llm_engine.save_routing_trace()
        trace = RoutingTrace.load(path)
    num_experts = llm.llm_engine.model_config.num_experts
    loads: dict[int, np.ndarray] = {}
    for layer, experts in trace:
        loads.setdefault(layer, np.zeros(num_experts))[list(experts)] += 1
    return [{"layer": layer, "max_over_mean": float(c.max() / c.mean()), "min_over_mean": float(c.min() / c.mean()),
             "tokens": int(c.sum() // 2)} for layer, c in sorted(loads.items())]


def finalize(out_dir: str, val_texts: list[str], hybrid: bool = False) -> None:
    """Record the fixed-text loss bound and the routing skew in training_metrics.json; for the
    hybrid also the MTP draft acceptance through moestream and a routing trace."""
    path = os.path.join(out_dir, "training_metrics.json")
    with open(path) as f:
        metrics = json.load(f)
    metrics["fixed_text_loss"] = fixed_text_loss(out_dir)
    metrics["routing_skew"] = routing_skew(out_dir, val_texts[:40])
    if hybrid:
        from train_demo_hybrid import mtp_acceptance, record_trace

        metrics["mtp_acceptance_k1"] = mtp_acceptance(out_dir)
        print(f"MTP draft acceptance at k=1 through moestream: {metrics['mtp_acceptance_k1']:.3f}")
        record_trace(out_dir, val_texts)
    with open(path, "w") as f:
        json.dump(metrics, f, indent=1)
    print(f"fixed-text loss {metrics['fixed_text_loss']:.4f}")
    for r in metrics["routing_skew"]:
        print(f"layer {r['layer']}: max/mean load {r['max_over_mean']:.2f}, min/mean {r['min_over_mean']:.2f}")


def learning_rate(peak: float, step: int, frac: float, warmup: int = 50) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 10% of `peak` over the time
    budget (`frac`: the fraction of it spent)."""
    return peak * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def plot_history(history: list[dict], path: str, title: str) -> None:
    """Training (LM) and held-out loss against step, to a PNG (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no loss plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train (LM loss)")
    v = [h for h in history if "val_loss" in h]
    ax.plot([h["step"] for h in v], [h["val_loss"] for h in v], "o-", label="held-out")
    if any("val_mtp_loss" in h for h in v):
        ax.plot([h["step"] for h in v], [h["val_mtp_loss"] for h in v], "s--", label="held-out MTP (token t+2)")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=40.0, help="training time budget (minutes)")
    ap.add_argument("--out", default=None, help="default: moestream/demo_model or moestream/demo_hybrid_model")
    ap.add_argument("--plot", default=None, help="default: docs/demo_model_loss.png or docs/demo_hybrid_model_loss.png")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--arch", choices=("qwen3_moe", "qwen3_5_moe"), default="qwen3_moe",
                    help="qwen3_moe: the default demo; qwen3_5_moe: the hybrid demo (Gated DeltaNet + gated "
                         "attention 3:1, shared expert, one MTP layer), written to moestream/demo_hybrid_model/")
    ap.add_argument("--bf16-autocast", action="store_true",
                    help="hybrid: train the matmuls in bf16 (torch.autocast; fast on CPUs with AMX or AVX512-BF16), "
                         "weights and optimizer in float32, evaluation in float32")
    ap.add_argument("--finalize-only", action="store_true",
                    help="skip training; record the fixed-text loss and routing skew of the checkpoint in --out")
    args = ap.parse_args()
    hybrid = args.arch == "qwen3_5_moe"
    name = "demo_hybrid_model" if hybrid else "demo_model"
    args.out = args.out or os.path.join(ROOT, "moestream", name)
    args.plot = args.plot or os.path.join(ROOT, "docs", f"{name}_loss.png")

    from transformers import AutoConfig, AutoModelForCausalLM

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    base = sysconfig.get_paths()["stdlib"]
    files = stdlib_files()
    train_texts = [read(f) for f in files if not is_heldout(f, base)]
    val_texts = [read(f) for f in files if is_heldout(f, base)]
    if args.finalize_only:
        finalize(args.out, val_texts, hybrid)
        return 0
    if hybrid:
        from train_demo_hybrid import train_hybrid

        return train_hybrid(args, train_texts, val_texts)
    print(f"{len(train_texts)} training files ({sum(map(len, train_texts)) / 1e6:.1f} MB), {len(val_texts)} held out", flush=True)
    t0 = time.time()
    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    train_ids, val_ids = encode(tokenizer, train_texts), encode(tokenizer, val_texts)
    print(f"tokenizer + encoding {time.time() - t0:.0f} s: {len(train_ids) / 1e6:.1f}M train tokens, "
          f"{len(val_ids) / 1e6:.2f}M held-out tokens", flush=True)

    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, moe_intermediate_size=96,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=True,
        output_router_logits=True, router_aux_loss_coef=0.02, rope_theta=10000.0,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.1f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(args.seed)
    val_rng = np.random.default_rng(args.seed + 1)
    val_starts = val_rng.integers(0, len(val_ids) - args.seq_len - 1, size=32)

    def batch(ids: np.ndarray, starts: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.stack([ids[s : s + args.seq_len + 1] for s in starts]).astype(np.int64))

    @torch.no_grad()
    def val_loss() -> float:
        model.eval()
        x = batch(val_ids, val_starts)
        losses = [model(input_ids=x[i : i + 8], labels=x[i : i + 8]).loss.item() for i in range(0, len(x), 8)]
        model.train()
        return float(np.mean(losses))

    budget = args.minutes * 60
    step, start = 0, time.time()
    history: list[dict] = []
    model.train()
    while time.time() - start < budget:
        lr = learning_rate(args.lr, step, (time.time() - start) / budget)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch(train_ids, rng.integers(0, len(train_ids) - args.seq_len - 1, size=args.batch))
        out = model(input_ids=x, labels=x)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0:
            rec = {"step": step, "seconds": time.time() - start, "loss": out.loss.item() - cfg.router_aux_loss_coef * out.aux_loss.item(),
                   "aux_loss": out.aux_loss.item(), "lr": lr}
            if step % 100 == 0:
                rec["val_loss"] = val_loss()
            history.append(rec)
            print(json.dumps(rec), flush=True)
    final_val = val_loss()
    print(f"done: {step} steps, held-out loss {final_val:.3f}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    model.config.output_router_logits = False
    # A small model repeats itself under greedy decoding; recommend a repetition penalty in
    # generation_config.json, which HF generate and moestream (as vLLM) apply by default.
    model.generation_config.repetition_penalty = 1.3
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    metrics = {"steps": step, "tokens_seen": step * args.batch * args.seq_len, "parameters": n_params,
               "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(val_ids)), "heldout_loss_fp32": final_val,
               "minutes": args.minutes, "seed": args.seed, "history": history}
    with open(os.path.join(args.out, "training_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    plot_history(history, args.plot, "moestream demo model")
    finalize(args.out, val_texts, hybrid)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
