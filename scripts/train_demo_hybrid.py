"""The hybrid demo model (`python scripts/train_demo_model.py --arch qwen3_5_moe`): a small
Qwen3.5-MoE text model (transformers' `Qwen3_5MoeForCausalLM`: Gated DeltaNet and gated
full-attention layers 3:1, 16 routed experts top-2 plus a gated shared expert) with one MTP
layer in the hub checkpoints' layout (`mtp.*`), trained jointly to predict token t+2.

Same text, held-out split and tokenizer as the first demo (its tokenizer is reused, so the
two held-out losses are in the same tokens). Load balancing: the Switch Transformer loss
(Fedus et al. 2021, eq. 4), E * sum_i f_i P_i, on every MoE layer separately, the MTP layer's
included. transformers' `load_balancing_loss_func` pools all layers' routing into one
count, so an expert dead in one layer and busy in another costs nothing there; the first demo
trained with it has a dead expert on five of its six layers.

MTP (Qwen3-Next / Qwen3.5, vLLM's qwen3_next_mtp.py; moestream.spec_decode.mtp at inference):
at position p, fc([norm_e(embed(x_{p+1})) | norm_h(h_p)]) -> one full-attention MoE decoder
layer -> norm -> the shared lm_head, a prediction of x_{p+2}; h_p is the main model's final
(normed) hidden state. Its loss is weighted 0.3 (DeepSeek-V3's lambda) and its gradient also
trains the main model.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import time

import numpy as np
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MTP_WEIGHT = 0.3
BALANCE_COEF = 0.01  # per MoE layer (Switch Transformer's alpha)
TRACE_PATH = os.path.join(ROOT, "tests", "fixtures", "traces", "demo_hybrid_heldout.npz")


def hybrid_config(vocab_size: int, eot: int):
    """The hybrid demo's `Qwen3_5MoeTextConfig`: 8 layers (linear x3, full) x2, hidden 256,
    16 experts of 64 top-2, shared expert 64; ~11M parameters + ~1.2M in the MTP layer."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=16, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, max_position_embeddings=2048,
        tie_word_embeddings=True, mtp_num_hidden_layers=1, eos_token_id=eot, bos_token_id=eot, pad_token_id=eot,
    )


class MTPHead(nn.Module):
    """Training twin of moestream's `MTPLayer`, built from transformers' Qwen3.5-MoE modules
    under the hub names (`fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `layers.0`, `norm`)."""

    def __init__(self, cfg) -> None:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm

        super().__init__()
        h = cfg.hidden_size
        layer_cfg = copy.deepcopy(cfg)  # one more full-attention layer after the model's
        layer_cfg.num_hidden_layers += 1
        layer_cfg.layer_types = list(cfg.layer_types) + ["full_attention"]
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3_5MoeDecoderLayer(layer_cfg, cfg.num_hidden_layers)])
        self.norm = Qwen3_5MoeRMSNorm(h, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, mask: torch.Tensor) -> torch.Tensor:
        """embeds, hidden [B, T, H] -> [B, T, H] (normed)."""
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1))
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=mask)
        return self.norm(x)


def balance_loss(records: list, num_experts: int) -> torch.Tensor:
    """Mean over MoE layers of E * sum_i f_i P_i (1.0 when balanced): f_i the fraction of
    (token, k) assignments to expert i, P_i its mean router probability."""
    total = 0.0
    for logits, _, ids in records:  # each router's output: logits [N, E], scores, ids [N, k]
        p = logits.float().softmax(dim=-1).mean(dim=0)  # [E]
        f = torch.bincount(ids.flatten(), minlength=num_experts).float() / ids.numel()  # [E]
        total = total + num_experts * (f * p).sum()
    return total / len(records)


def forward_losses(model, mtp: MTPHead, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x [B, T+1] int64 -> LM loss (predict t+1), MTP loss and top-1 accuracy (predict t+2)."""
    inp, labels = x[:, :-1], x[:, 1:]
    b, t = inp.shape
    h = model.model(input_ids=inp).last_hidden_state  # [B, T, H], after the final norm
    logits = model.lm_head(h)  # [B, T, V]
    lm = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    pos = torch.arange(t - 1).view(1, 1, -1).expand(3, b, -1)  # M-RoPE's 3 axes, all text positions
    emb = model.model.embed_tokens(inp[:, 1:])  # [B, T-1, H]: x_{p+1}
    rope = model.model.rotary_emb(emb, pos)
    mask = torch.full((t - 1, t - 1), float("-inf")).triu(1)[None, None]  # [1, 1, T-1, T-1] causal
    mtp_logits = model.lm_head(mtp(emb, h[:, :-1], rope, mask))  # [B, T-1, V]: x_{p+2}
    mtp_labels = x[:, 2:]
    mtp_loss = nn.functional.cross_entropy(mtp_logits.flatten(0, 1).float(), mtp_labels.flatten())
    acc = (mtp_logits.argmax(-1) == mtp_labels).float().mean()
    return {"lm": lm, "mtp": mtp_loss, "mtp_acc": acc}


def save_hybrid(model, mtp: MTPHead, out_dir: str) -> None:
    """Write the model with transformers' `save_pretrained`, then add the MTP tensors under
    the hub names (its decoder layer named by saving it as layer 0 of a 1-layer model)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

    model.to(torch.bfloat16).save_pretrained(out_dir)
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers, cfg.layer_types = 1, ["full_attention"]
    one = Qwen3_5MoeForCausalLM(cfg)
    one.model.layers[0].load_state_dict(mtp.layers[0].state_dict())
    path = os.path.join(out_dir, "model.safetensors")
    with tempfile.TemporaryDirectory() as tmp:
        one.to(torch.bfloat16).save_pretrained(tmp)
        with safe_open(os.path.join(tmp, "model.safetensors"), framework="pt") as f:
            extra = {"mtp.layers.0." + n[len("model.layers.0."):]: f.get_tensor(n)
                     for n in f.keys() if n.startswith("model.layers.0.")}
    for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        extra[f"mtp.{name}.weight"] = getattr(mtp, name).weight.detach().to(torch.bfloat16).contiguous()
    with safe_open(path, framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    save_file({**tensors, **extra}, path, metadata={"format": "pt"})


def train_hybrid(args, train_texts: list[str], val_texts: list[str]) -> int:
    from train_demo_model import encode, learning_rate, plot_history
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "moestream", "demo_model"))
    train_ids, val_ids = encode(tokenizer, train_texts), encode(tokenizer, val_texts)
    print(f"encoding {time.time() - t0:.0f} s (the first demo's tokenizer): {len(train_ids) / 1e6:.1f}M train tokens, "
          f"{len(val_ids) / 1e6:.2f}M held-out tokens", flush=True)
    cfg = hybrid_config(len(tokenizer), tokenizer.eos_token_id)
    model = Qwen3_5MoeForCausalLM(cfg)
    mtp = MTPHead(model.config)
    for module in mtp.modules():  # transformers' init (expert weights are allocated uninitialised)
        model._init_weights(module)
    params = list(model.parameters()) + list(mtp.parameters())
    n_main, n_mtp = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in mtp.parameters())
    print(f"model: {n_main / 1e6:.2f}M parameters + MTP {n_mtp / 1e6:.2f}M", flush=True)
    records: list = []
    for module in list(model.modules()) + list(mtp.modules()):
        if isinstance(module, Qwen3_5MoeTopKRouter):
            module.register_forward_hook(lambda mod, inp, out: records.append(out))
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(args.seed)
    val_starts = np.random.default_rng(args.seed + 1).integers(0, len(val_ids) - args.seq_len - 1, size=32)

    def batch(ids: np.ndarray, starts: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.stack([ids[s : s + args.seq_len + 1] for s in starts]).astype(np.int64))

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        model.eval()
        mtp.eval()
        x = batch(val_ids, val_starts)
        outs = [forward_losses(model, mtp, x[i : i + 8]) for i in range(0, len(x), 8)]
        records.clear()
        model.train()
        mtp.train()
        return {k: float(np.mean([o[k].item() for o in outs])) for k in ("lm", "mtp", "mtp_acc")}

    budget = args.minutes * 60
    step, start = 0, time.time()
    history: list[dict] = []
    model.train()
    while time.time() - start < budget:
        lr = learning_rate(args.lr, step, (time.time() - start) / budget)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch(train_ids, rng.integers(0, len(train_ids) - args.seq_len - 1, size=args.batch))
        records.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16_autocast):
            out = forward_losses(model, mtp, x)
        balance = balance_loss(records, cfg.num_experts)
        loss = out["lm"] + MTP_WEIGHT * out["mtp"] + BALANCE_COEF * len(records) * balance
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 10 == 0:
            rec = {"step": step, "seconds": time.time() - start, "loss": out["lm"].item(), "mtp_loss": out["mtp"].item(),
                   "balance": balance.item(), "lr": lr}
            if step % 100 == 0:
                ev = evaluate()
                rec.update(val_loss=ev["lm"], val_mtp_loss=ev["mtp"], val_mtp_acc=ev["mtp_acc"])
            history.append(rec)
            print(json.dumps(rec), flush=True)
    final = evaluate()
    print(f"done: {step} steps, held-out loss {final['lm']:.3f}, MTP loss {final['mtp']:.3f}, "
          f"MTP top-1 {final['mtp_acc']:.3f}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    save_hybrid(model, mtp, args.out)
    tokenizer.save_pretrained(args.out)
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
                     repetition_penalty=1.3).save_pretrained(args.out)
    metrics = {"arch": "qwen3_5_moe", "steps": step, "tokens_seen": step * args.batch * args.seq_len,
               "parameters": n_main, "mtp_parameters": n_mtp, "train_tokens": int(len(train_ids)),
               "heldout_tokens": int(len(val_ids)), "heldout_loss_fp32": final["lm"], "heldout_mtp_loss_fp32": final["mtp"],
               "heldout_mtp_top1": final["mtp_acc"], "mtp_loss_weight": MTP_WEIGHT, "balance_coef_per_layer": BALANCE_COEF,
               "minutes": args.minutes, "seed": args.seed, "bf16_autocast": args.bf16_autocast,
               "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr, "history": history}
    with open(os.path.join(args.out, "training_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    plot_history(history, args.plot, "moestream hybrid demo model (Qwen3.5-MoE, MTP)")
    from train_demo_model import finalize

    finalize(args.out, val_texts, hybrid=True)
    return 0


def heldout_prompts(tokenizer, val_texts: list[str], n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `n` held-out files that have that many."""
    out = []
    for text in val_texts:
        ids = tokenizer.encode(text)
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            break
    return out


def mtp_acceptance(out_dir: str, k: int = 1) -> float:
    """Draft acceptance rate of moestream's MTP speculative decoding (k drafts, greedy, float32)
    on the fixed held-out text's first 512 tokens, continued for 128 tokens."""
    from moestream import LLM, SamplingParams
    from train_demo_model import FIXED_TEXT

    llm = LLM(out_dir, dtype="float32", max_model_len=2048,
              speculative_config={"method": "mtp", "num_speculative_tokens": k, "adaptive": False})
    ids = llm.get_tokenizer().encode(open(FIXED_TEXT).read())
    prompts = [{"prompt_token_ids": ids[i : i + 256]} for i in range(0, min(len(ids), 1024) - 256, 128)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, repetition_penalty=1.0), use_tqdm=False)
    return float(llm.spec_decode_stats()["acceptance_rate"])


def record_trace(out_dir: str, val_texts: list[str]) -> None:
    """A routing trace of the hybrid on held-out text, prompts and 64 generated tokens each, to
    `tests/fixtures/traces/demo_hybrid_heldout.npz` (moestream's own trace format)."""
    from moestream import LLM, SamplingParams

    llm = LLM(out_dir, dtype="float32", max_model_len=2048, record_routing=TRACE_PATH)
    prompts = heldout_prompts(llm.get_tokenizer(), val_texts[40:], 24, 96)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=64),
                 use_tqdm=False)
    llm.llm_engine.save_routing_trace()
    print(f"routing trace: {TRACE_PATH} ({os.path.getsize(TRACE_PATH)} bytes)")
