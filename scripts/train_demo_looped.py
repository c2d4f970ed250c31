"""Train the built-in looped demo (`demo-looped`): a small Foil-style looped MoE (`loop-moe`)
on the same text and tokenizer as the other demos (the Python standard library; the demo's
byte-level BPE), saved in the reference's layout (SR-A-W/how-to-loop-moe-iclr27-submission,
`src/model/modeling_loop_lm.py`) so that moestream reads it as any loop-moe checkpoint.

The model here is written from the reference's equations for training (moestream's own
model is inference-only): one head layer and one tail layer with 8 experts, a stack of L=2
layers run R=4 times with per-pass attention, 16 experts top-2 in the stack, gain-free
RMSNorm, attention scaled by 1/d_k, RoPE on adjacent pairs, float32 softmax router
renormalised over the top-k, the reference's load-balancing (E * sum f_i p_i) and router
z-loss, muP-style initialisation. Files whose path hashes to 0 mod 20 are held out.

Writes moestream/demo_looped_model/ (config.json, model.safetensors in bf16 without the
rotary tables, which readers recompute, tokenizer, generation_config.json,
training_metrics.json), docs/demo_looped_model_loss.png and the routing trace fixture
tests/fixtures/traces/demo_looped_heldout.npz.

    python scripts/train_demo_looped.py [--minutes 45]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import sysconfig
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_demo_model import ROOT, encode, is_heldout, learning_rate, plot_history, read, stdlib_files  # noqa: E402

CONFIG = dict(model_type="loop-moe", architectures=["LoopMoEForCausalLM"], context_length=2048, d_model=256,
              num_heads=4, d_ff=256, rope_theta=10000.0, width_ratio=2.0, num_layers_in_stack=2, num_stacks=4,
              num_experts=16, num_active=2, lb_loss_factor=0.01, lz_loss_factor=0.001, num_head_layers=1,
              num_tail_layers=1, per_pass_attention=True)
OUTER_EXPERTS = 8


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class Attn(nn.Module):
    def __init__(self, d: int, heads: int, std: float) -> None:
        super().__init__()
        self.heads = heads
        for n in ("q_proj", "k_proj", "v_proj", "output_proj"):
            setattr(self, n, nn.Linear(d, d, bias=False))
            nn.init.trunc_normal_(getattr(self, n).weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        dk = d // self.heads

        def split(t: torch.Tensor, rope: bool) -> torch.Tensor:
            t = t.view(b, s, self.heads, dk).transpose(1, 2)  # [B, h, S, dk]
            if not rope:
                return t
            x0, x1 = t[..., 0::2], t[..., 1::2]
            return torch.stack((cos * x0 - sin * x1, sin * x0 + cos * x1), -1).flatten(-2)

        q, k, v = split(self.q_proj(x), True), split(self.k_proj(x), True), split(self.v_proj(x), False)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / dk)
        return self.output_proj(o.transpose(1, 2).reshape(b, s, d))


class MoE(nn.Module):
    def __init__(self, d: int, width: int, num: int, k: int, ratio: float) -> None:
        super().__init__()
        self.num, self.k = num, k
        self.gate = nn.Linear(d, num, bias=False)
        std_r = math.sqrt(2 / (128 + num)) / math.sqrt(ratio)
        nn.init.trunc_normal_(self.gate.weight, std=std_r, a=-3 * std_r, b=3 * std_r)
        std = math.sqrt(2 / (128 + 384)) / math.sqrt(ratio)
        self.experts_w1 = nn.Parameter(torch.empty(num, d, width))
        self.experts_w3 = nn.Parameter(torch.empty(num, d, width))
        self.experts_w2 = nn.Parameter(torch.empty(num, width, d))
        for w in (self.experts_w1, self.experts_w2, self.experts_w3):
            nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x).float()
        probs = logits.softmax(-1)
        top, ids = probs.topk(self.k, -1)
        top = (top / top.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        counts = torch.bincount(ids.flatten(), minlength=self.num)
        for e in range(self.num):
            rows, slot = (ids == e).nonzero(as_tuple=True)
            if rows.numel():
                h = x[rows]
                y = (F.silu(h @ self.experts_w1[e]) * (h @ self.experts_w3[e])) @ self.experts_w2[e]
                out = out.index_add(0, rows, y * top[rows, slot, None])
        lb = self.num * (counts.float() / (x.shape[0] * self.k) * probs.mean(0)).sum()
        lz = torch.logsumexp(logits, -1).pow(2).mean()
        return out.view(shape), lb, lz


class LoopedLM(nn.Module):
    def __init__(self, vocab: int, c: dict) -> None:
        super().__init__()
        d, ratio = c["d_model"], c["width_ratio"]
        self.c = c
        std_a = math.sqrt(2 / 256) / math.sqrt(ratio)
        width = c["d_ff"] // c["num_active"]
        self.token_embeddings = nn.Parameter(torch.empty(vocab, d))
        nn.init.trunc_normal_(self.token_embeddings, std=1.0, a=-3, b=3)

        def block(num: int, attn_sets: int) -> nn.Module:
            m = nn.Module()
            m.attn = Attn(d, c["num_heads"], std_a) if attn_sets == 1 else nn.ModuleList(
                Attn(d, c["num_heads"], std_a) for _ in range(attn_sets))
            m.moe = MoE(d, width, num, c["num_active"], ratio)
            return m

        self.head_layers = nn.ModuleList(block(OUTER_EXPERTS, 1) for _ in range(c["num_head_layers"]))
        self.stack = nn.ModuleList(block(c["num_experts"], c["num_stacks"]) for _ in range(c["num_layers_in_stack"]))
        self.tail_layers = nn.ModuleList(block(OUTER_EXPERTS, 1) for _ in range(c["num_tail_layers"]))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        std_h = math.sqrt(2 / (128 + vocab)) / math.sqrt(ratio)
        nn.init.trunc_normal_(self.lm_head.weight, std=std_h, a=-3 * std_h, b=3 * std_h)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.c
        s, dk = ids.shape[1], c["d_model"] // c["num_heads"]
        j = torch.arange(dk // 2, dtype=torch.float64)
        ang = torch.arange(s, dtype=torch.float64)[:, None] / c["rope_theta"] ** (2 * j / dk)
        cos, sin = ang.cos().float(), ang.sin().float()
        x = self.token_embeddings[ids]
        lb = lz = x.new_zeros(())

        def layer(m: nn.Module, attn: Attn, x: torch.Tensor) -> torch.Tensor:
            nonlocal lb, lz
            x = x + attn(rms(x), cos, sin)
            y, b, z = m.moe(rms(x))
            lb, lz = lb + b, lz + z
            return x + y

        for m in self.head_layers:
            x = layer(m, m.attn, x)
        for r in range(c["num_stacks"]):
            for m in self.stack:
                x = layer(m, m.attn[r], x)
        for m in self.tail_layers:
            x = layer(m, m.attn, x)
        depth = c["num_head_layers"] + c["num_layers_in_stack"] * c["num_stacks"] + c["num_tail_layers"]
        return self.lm_head(rms(x)), lb / depth, lz / depth

    def reference_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under the reference's names (without its rotary tables)."""
        out = {"model.token_embeddings.weight": self.token_embeddings, "model.lm_head.weight": self.lm_head.weight}

        def put(prefix: str, m: nn.Module, attn_prefixes: list[tuple[str, Attn]]) -> None:
            for p, a in attn_prefixes:
                for n in ("q_proj", "k_proj", "v_proj", "output_proj"):
                    out[f"{p}.{n}.weight"] = getattr(a, n).weight
            out[f"{prefix}.router.gate.weight"] = m.moe.gate.weight
            for n in ("experts_w1", "experts_w2", "experts_w3"):
                out[f"{prefix}.{n}"] = getattr(m.moe, n)

        for block, layers in (("head", self.head_layers), ("tail", self.tail_layers)):
            for i, m in enumerate(layers):
                put(f"model.{block}_layers.{i}", m, [(f"model.{block}_layers.{i}.attn", m.attn)])
        for i, m in enumerate(self.stack):
            put(f"model.stack.layers.{i}", m, [(f"model.stack.layers.{i}.attn.{r}", a) for r, a in enumerate(m.attn)])
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in out.items()}


def moestream_loss(out_dir: str, text_path: str) -> float:
    """Mean cross-entropy (nats/token) of the saved checkpoint on a text, through moestream's
    prompt logprobs in float32."""
    from moestream import LLM, SamplingParams

    llm = LLM(out_dir, dtype="float32", max_model_len=2048)
    with open(text_path) as f:
        ids = llm.get_tokenizer().encode(f.read())[:2048]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    lps = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])]
    return -float(np.mean(lps))


TRACE_PATH = os.path.join(ROOT, "tests", "fixtures", "traces", "demo_looped_heldout.npz")


def record_trace(out_dir: str, val_texts: list[str]) -> None:
    """The looped demo's routing on held-out text (16 prompts of 96 tokens, 32 greedy tokens
    each), with each access's pass, to `tests/fixtures/traces/demo_looped_heldout.npz`."""
    from moestream import LLM, SamplingParams

    llm = LLM(out_dir, dtype="float32", max_model_len=512, record_routing=TRACE_PATH)
    tok = llm.get_tokenizer()
    prompts = [ids[:96] for ids in (tok.encode(t) for t in val_texts[40:120]) if len(ids) >= 96][:16]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=32),
                 use_tqdm=False)
    llm.llm_engine.save_routing_trace()
    print(f"routing trace: {TRACE_PATH} ({os.path.getsize(TRACE_PATH)} bytes)", flush=True)


def finalize(out_dir: str, val_texts: list[str]) -> None:
    """Record the fixed-text loss bound (through moestream) in training_metrics.json, and the
    routing trace fixture."""
    path = os.path.join(out_dir, "training_metrics.json")
    with open(path) as f:
        metrics = json.load(f)
    metrics["fixed_text_loss"] = moestream_loss(out_dir, os.path.join(ROOT, "tests", "fixtures", "demo_heldout.txt"))
    with open(path, "w") as f:
        json.dump(metrics, f, indent=1)
    print(f"fixed-text loss through moestream {metrics['fixed_text_loss']:.4f}", flush=True)
    record_trace(out_dir, val_texts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=40.0, help="training time budget (minutes)")
    ap.add_argument("--out", default=os.path.join(ROOT, "moestream", "demo_looped_model"))
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "demo_looped_model_loss.png"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--finalize-only", action="store_true",
                    help="skip training; record the fixed-text loss and the routing trace of the checkpoint in --out")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    torch.manual_seed(args.seed)
    tok_dir = os.path.join(ROOT, "moestream", "demo_model")  # the demos' tokenizer
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    base = sysconfig.get_paths()["stdlib"]
    files = stdlib_files()
    eot = tokenizer.eos_token_id
    if args.finalize_only:
        finalize(args.out, [read(f) for f in files if is_heldout(f, base)])
        return 0
    train_ids = encode(tokenizer, [read(f) for f in files if not is_heldout(f, base)])
    val_ids = encode(tokenizer, [read(f) for f in files if is_heldout(f, base)])
    print(f"{len(train_ids) / 1e6:.1f}M train tokens, {len(val_ids) / 1e6:.2f}M held-out", flush=True)
    cfg = {**CONFIG, "vocab_size": len(tokenizer), "eos_token_id": eot, "bos_token_id": eot}
    model = LoopedLM(len(tokenizer), cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.1f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng, val_rng = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)
    val_starts = val_rng.integers(0, len(val_ids) - args.seq_len - 1, size=32)

    def batch(ids: np.ndarray, starts: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.stack([ids[s:s + args.seq_len + 1] for s in starts]).astype(np.int64))

    def lm_loss(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, lb, lz = model(x[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()), lb, lz

    @torch.no_grad()
    def val_loss() -> float:
        x = batch(val_ids, val_starts)
        return float(np.mean([lm_loss(x[i:i + 8])[0].item() for i in range(0, len(x), 8)]))

    budget, step, start, history = args.minutes * 60, 0, time.time(), []
    while time.time() - start < budget:
        lr = learning_rate(args.lr, step, (time.time() - start) / budget)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, lb, lz = lm_loss(batch(train_ids, rng.integers(0, len(train_ids) - args.seq_len - 1, size=args.batch)))
        total = loss + cfg["lb_loss_factor"] * lb + cfg["lz_loss_factor"] * lz
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0:
            rec = {"step": step, "seconds": time.time() - start, "loss": loss.item(), "lb_loss": lb.item(),
                   "z_loss": lz.item(), "lr": lr}
            if step % 100 == 0:
                rec["val_loss"] = val_loss()
            history.append(rec)
            print(json.dumps(rec), flush=True)
    final_val = val_loss()
    print(f"done: {step} steps, held-out loss {final_val:.3f}", flush=True)

    from safetensors.torch import save_file

    os.makedirs(args.out, exist_ok=True)
    save_file(model.reference_state_dict(), os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({**cfg, "torch_dtype": "bfloat16"}, f, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(tok_dir, name), args.out)
    metrics = {"steps": step, "tokens_seen": step * args.batch * args.seq_len, "parameters": n_params,
               "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(val_ids)), "heldout_loss_fp32": final_val,
               "minutes": args.minutes, "seed": args.seed, "history": history}
    with open(os.path.join(args.out, "training_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    plot_history(history, args.plot, "moestream looped demo model (loop-moe)")
    finalize(args.out, [read(f) for f in files if is_heldout(f, base)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
