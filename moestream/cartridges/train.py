"""`--method train`: Cartridges' context distillation (Eyuboglu et al. 2025, arXiv 2506.06266, §4).

The cartridge's keys and values (per attention layer, p positions) are trainable tensors,
initialised from the cache entries of the document's first p tokens (the paper's
initialisation). They are optimised with Adam so that the model with the cartridge in its
cache predicts what the model with the whole document in context predicts: over training
texts x, the loss is the cross-entropy of the student's next-token distribution against the
teacher's top-64 probabilities (the KL divergence up to the teacher's entropy), averaged
over the positions of x.

The training texts stand in for the paper's self-study conversations, at the scale of the
built-in demos on a CPU: spans of the document itself, and the model's own continuations
of short document spans, sampled with the document in context (seeded). The data-mixing
variant of Cartridges++ replaces a `mix_fraction` share of them by off-document text, still
distilled from the teacher with the document in context.

The forward passes are transformers' (the test reference), in float32: its attention and
experts are differentiable; the engine's paged kernels are not. So this builder serves the
architectures transformers runs with a per-head KV cache (Qwen3-MoE, Mixtral, GLM-4.5);
multi-head latent attention and hybrid models are refused.
"""

from __future__ import annotations

import inspect
import logging
import random
from dataclasses import dataclass

import torch

from moestream.cartridges.build import prefill_document
from moestream.cartridges.format import Cartridge, CartridgeError, model_fingerprint
from moestream.engine.llm_engine import LLMEngine
from moestream.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

TEACHER_TOP_K = 64
BATCH = 4
SEED_SPAN = 8  # tokens of the document that start a self-generated continuation


@dataclass(frozen=True)
class TrainConfig:
    """`--method train`'s options.

    Attributes:
        num_tokens: p, the cartridge's positions.
        steps: Adam steps (batches of 4 texts).
        lr: Adam's learning rate.
        num_samples: training texts.
        sample_len: tokens per training text.
        mix_fraction: share of off-document texts in [0, 1).
        off_document: off-document text files (default: the demos' training split).
        seed: seed of the texts, the continuations' sampling and the batch order.
    """

    num_tokens: int = 256
    steps: int = 60
    lr: float = 1e-2
    num_samples: int = 32
    sample_len: int = 32
    mix_fraction: float = 0.0
    off_document: tuple[str, ...] = ()
    seed: int = 0


def training_texts(engine: LLMEngine, doc: list[int], cfg: TrainConfig) -> list[list[int]]:
    """`cfg.num_samples` texts of `cfg.sample_len` tokens: document spans, the model's own
    continuations of document spans (sampled with the document in context), and a
    `mix_fraction` share of off-document spans, in a seeded order."""
    rng = random.Random(cfg.seed)
    n = cfg.sample_len
    num_off = round(cfg.num_samples * cfg.mix_fraction)
    num_on = cfg.num_samples - num_off
    spans = [doc[s:s + n] for s in (rng.randrange(0, len(doc) - n + 1) for _ in range((num_on + 1) // 2))]
    seeds = [doc[s:s + SEED_SPAN] for s in (rng.randrange(0, len(doc) - SEED_SPAN + 1) for _ in range(num_on // 2))]
    params = [SamplingParams(temperature=1.0, max_tokens=n - SEED_SPAN, ignore_eos=True, seed=cfg.seed * 1000 + i)
              for i in range(len(seeds))]
    rids = [engine.add_request({"prompt_token_ids": doc + s}, p) for s, p in zip(seeds, params)]
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    texts = spans + [s + list(outs[r]) for s, r in zip(seeds, rids)]
    if num_off:
        from moestream.demo import training_files

        ids = []
        for path in cfg.off_document or training_files():
            with open(path, encoding="utf-8", errors="replace") as f:
                ids += engine.tokenizer.encode(f.read(), add_special_tokens=False)
            if len(ids) >= 8 * num_off * n:
                break
        if len(ids) < n:
            raise CartridgeError(f"the off-document text has fewer than {n} tokens")
        texts += [ids[s:s + n] for s in (rng.randrange(0, len(ids) - n + 1) for _ in range(num_off))]
    rng.shuffle(texts)
    return texts


def _hf_cache(model, keys: list[torch.Tensor], values: list[torch.Tensor], batch: int):
    """A transformers DynamicCache holding the cartridge ([heads, p, dim] per layer) for `batch` rows."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(zip(keys, values)):
        cache.update(k[None].expand(batch, -1, -1, -1), v[None].expand(batch, -1, -1, -1), i)
    return cache


def _student_logits(model, keys: list[torch.Tensor], values: list[torch.Tensor], texts: torch.Tensor) -> torch.Tensor:
    """Logits [B, L, V] of `texts` [B, L] after the cartridge (positions p, p+1, ...)."""
    b, n = texts.shape
    p = keys[0].shape[1]
    pos = torch.arange(p, p + n)[None].expand(b, -1)
    mask = torch.ones(b, p + n, dtype=torch.long)
    # transformers 5.24 names the argument `cache`, earlier releases `past_key_values`
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(texts, position_ids=pos, attention_mask=mask, **{name: _hf_cache(model, keys, values, b)}).logits


def train_cartridge(engine: LLMEngine, doc: list[int], cartridge_id: str, cfg: TrainConfig) -> Cartridge:
    """Train a cartridge of `cfg.num_tokens` positions for document `doc` on `engine`'s model
    (see the module docstring). Deterministic for a seed on one machine and thread count.

    Raises:
        CartridgeError: a model this builder does not serve (MLA, hybrid), a document shorter
            than p or than a training text, or options out of range.
    """
    from transformers import AutoModelForCausalLM

    mcfg = engine.model_config
    if mcfg.mla is not None or mcfg.is_hybrid:
        raise CartridgeError("--method train serves models with per-head KV caches and no linear-attention layers "
                             "(Qwen3-MoE, Mixtral, GLM-4.5) yet; use --method prefix or knorm")
    p, n = cfg.num_tokens, cfg.sample_len
    if not 1 <= p <= len(doc) or n < 2 or len(doc) < n:
        raise CartridgeError(f"--method train needs 1 <= --num-tokens <= {len(doc)} (the document's length) and "
                             f"2 <= --sample-len <= {len(doc)}; got {p} and {n}")
    if cfg.steps < 1 or cfg.num_samples < 2 or cfg.lr <= 0:
        raise CartridgeError("--steps must be at least 1, --num-samples at least 2 and --lr above 0")
    torch.manual_seed(cfg.seed)
    texts = training_texts(engine, doc, cfg)
    init_k, init_v, _, _ = prefill_document(engine, doc[:p])
    model = AutoModelForCausalLM.from_pretrained(engine.config.model, dtype=torch.float32).eval()
    model.requires_grad_(False)
    batch_texts = torch.tensor(texts)  # [S, n]
    targets = []
    with torch.no_grad():  # the teacher: the whole document in context, top-64 of each position
        for i in range(len(texts)):
            logits = model(torch.tensor([doc + texts[i]])).logits[0, len(doc):].float()  # [n, V]
            lp = logits.log_softmax(-1).topk(TEACHER_TOP_K, dim=-1)
            targets.append((lp.indices, lp.values.exp() / lp.values.exp().sum(-1, keepdim=True)))
    keys = [torch.nn.Parameter(k.float().permute(1, 0, 2).contiguous()) for k in init_k]  # [heads, p, dim]
    values = [torch.nn.Parameter(v.float().permute(1, 0, 2).contiguous()) for v in init_v]
    opt = torch.optim.Adam([*keys, *values], lr=cfg.lr)
    order = random.Random(cfg.seed + 1)
    for step in range(cfg.steps):
        idx = order.sample(range(len(texts)), min(BATCH, len(texts)))
        logp = _student_logits(model, keys, values, batch_texts[idx]).float().log_softmax(-1)  # [B, n, V]
        ti = torch.stack([targets[i][0] for i in idx])
        tp = torch.stack([targets[i][1] for i in idx])
        loss = -(tp * logp.gather(-1, ti)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            logger.info("cartridge train step %d/%d: distillation loss %.4f", step + 1, cfg.steps, loss.item())
    dtype = init_k[0].dtype
    out_k = tuple(k.detach().permute(1, 0, 2).to(dtype).contiguous() for k in keys)
    out_v = tuple(v.detach().permute(1, 0, 2).to(dtype).contiguous() for v in values)
    args = {"steps": cfg.steps, "lr": cfg.lr, "num_samples": cfg.num_samples, "sample_len": n,
            "mix_fraction": cfg.mix_fraction, "seed": cfg.seed, "document_tokens": len(doc)}
    return Cartridge(cartridge_id, p, model_fingerprint(engine.config.model), "train", out_k, out_v, builder_args=args)
