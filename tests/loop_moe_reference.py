"""An independent float32 oracle of the loop-moe architecture, written from its reference
(`src/model/modeling_loop_lm.py` of SR-A-W/how-to-loop-moe-iclr27-submission): no KV
cache, the whole sequence recomputed per token, as the reference's own `generate`. It
shares no code with moestream: it reads the safetensors itself, uses the checkpoint's
stored `rope.rotations` tables, and computes each expert over its (token, slot) pairs.

    logits = LoopMoEReference(model_dir).forward(ids)   # ids [S] -> [S, V] float32
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class LoopMoEReference:
    def __init__(self, model_dir: str) -> None:
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = json.load(f)
        self.w = {k: v.float() for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}
        self.routes: list[tuple[str, torch.Tensor]] = []  # the last forward's (layer prefix, top-k ids [S, k]) in run order

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:  # RMSNorm without gain, eps 1e-5
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + 1e-5)

    def _table(self, s: int, d_k: int) -> torch.Tensor:
        """The reference's rotation table, for checkpoints saved without it: rows [[cos, -sin],
        [sin, cos]] of pos / theta^(2j / d_k), in float64, then float32."""
        pos = torch.arange(s, dtype=torch.float64)[:, None]
        ang = pos / self.cfg["rope_theta"] ** (2 * torch.arange(d_k // 2, dtype=torch.float64) / d_k)
        return torch.stack([torch.stack([ang.cos(), -ang.sin()], -1),
                            torch.stack([ang.sin(), ang.cos()], -1)], -2).float()

    def _attention(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w, c = self.w, self.cfg
        s, heads = x.shape[0], c["num_heads"]
        d_k = c["d_model"] // heads
        rot = w[p + ".rope.rotations"][:s] if p + ".rope.rotations" in w else self._table(s, d_k)  # [S, d_k/2, 2, 2]

        def heads_of(name: str, rope: bool) -> torch.Tensor:
            h = (x @ w[f"{p}.{name}.weight"].T).view(s, heads, d_k).transpose(0, 1)  # [heads, S, d_k]
            if not rope:
                return h
            pairs = h.unflatten(-1, (d_k // 2, 2))  # [heads, S, d_k/2, 2]
            return torch.einsum("sfij,hsfj->hsfi", rot, pairs).flatten(-2)

        q, k, v = heads_of("q_proj", True), heads_of("k_proj", True), heads_of("v_proj", False)
        scores = (q @ k.transpose(1, 2)) / d_k  # muP: 1 / d_k
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(s, heads * d_k)
        return o @ w[p + ".output_proj.weight"].T

    def _moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w, k = self.w, self.cfg["num_active"]
        probs = (x @ w[p + ".router.gate.weight"].T).float().softmax(-1)  # over all experts
        top, ids = probs.topk(k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        self.routes.append((p, ids))
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():  # each (token, expert) pair of expert e
            t, j = (ids == e).nonzero(as_tuple=True)
            h = F.silu(x[t] @ w[p + ".experts_w1"][e]) * (x[t] @ w[p + ".experts_w3"][e])
            out.index_add_(0, t, top[t, j, None] * (h @ w[p + ".experts_w2"][e]))
        return out

    def _layer(self, block: str, attn: str, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(attn, self._norm(x))
        return x + self._moe(block, self._norm(x))

    def forward(self, ids: list[int]) -> torch.Tensor:
        c, w = self.cfg, self.w
        self.routes = []
        x = w["model.token_embeddings.weight"][torch.tensor(ids)]
        for i in range(c.get("num_head_layers", 0)):
            x = self._layer(f"model.head_layers.{i}", f"model.head_layers.{i}.attn", x)
        for r in range(c["num_stacks"]):
            for l in range(c["num_layers_in_stack"]):
                p = f"model.stack.layers.{l}"
                x = self._layer(p, f"{p}.attn.{r}" if c.get("per_pass_attention") else f"{p}.attn", x)
        for i in range(c.get("num_tail_layers", 0)):
            x = self._layer(f"model.tail_layers.{i}", f"model.tail_layers.{i}.attn", x)
        return self._norm(x) @ w["model.lm_head.weight"].T

    def greedy(self, ids: list[int], n: int, repetition_penalty: float = 1.0) -> tuple[list[int], list[torch.Tensor]]:
        """n greedy tokens after `ids`, and the log-softmax [V] of the raw logits each was chosen
        from. `repetition_penalty` as HF's (CTRL, arXiv 1909.05858): the logit of every token
        seen so far is divided by it when positive, multiplied when not."""
        out, logps = [], []
        for _ in range(n):
            logits = self.forward(ids + out)[-1]
            logps.append(logits.log_softmax(-1))
            if repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(ids + out)))
                picked = logits[seen]
                logits = logits.clone()
                logits[seen] = torch.where(picked > 0, picked / repetition_penalty, picked * repetition_penalty)
            out.append(int(logits.argmax()))
        return out, logps
