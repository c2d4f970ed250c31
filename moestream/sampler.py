"""Token sampling: logits processors, penalties, temperature, min-p/top-k/top-p and seeded draws.

Follows vLLM v1 vllm/v1/sample/sampler.py (order of operations, raw logprobs) with the masking
rules of vllm/v1/sample/ops/topk_topp_sampler.py and penalties of vllm/model_executor/layers/utils.py.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moestream.kernels.sampling import argmax_rows

from moestream.sampling_params import SamplingParams
from moestream.structured_output.backend import GrammarMatcher


@dataclass
class SamplerOutput:
    """Result of one sampling step for B rows.

    token_ids: the sampled token id per row, length B.
    logprobs: per row, None if that request asked for no logprobs, else
        [(token_id, logprob, rank), ...]: the sampled token first, then the top-N tokens
        (rank 1..N). Logprobs are natural logs of the raw distribution (after
        logits_processors, before penalties/temperature); ranks are 1-based.
    errors: per row, the exception a logits processor raised, else None. A failed row's
        token is drawn from its unprocessed logits and must not be used.
    """

    token_ids: list[int]
    logprobs: list[list[tuple[int, float, int]] | None]
    errors: list[Exception | None]


def make_generator(seed: int | None, device: torch.device = torch.device("cpu")) -> torch.Generator | None:
    """A torch.Generator seeded with `seed` on `device`, or None when `seed` is None."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def apply_penalties(logits: torch.Tensor, prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Apply repetition, presence and frequency penalties in place and return `logits`.

    logits: [B, V] float32. repetition/presence/frequency: [B] float32 (1.0, 0.0, 0.0 = off).
    Repetition hits every id in prompt or output: positive logits are divided by it, the rest
    multiplied. Presence subtracts `presence` once per id present in the output; frequency
    subtracts `frequency * count` in the output. Follows vLLM apply_penalties.
    Token ids must be in [0, V); otherwise torch raises an index error.
    """
    B, V = logits.shape
    dev = logits.device
    counts = torch.zeros(B, V, dtype=torch.float32, device=dev)  # [B, V] output-token counts
    seen = torch.zeros(B, V, dtype=torch.bool, device=dev)  # [B, V] id in prompt or output
    for i in range(B):
        out = torch.tensor(output_token_ids[i], dtype=torch.long, device=dev)  # [n_out]
        counts[i].index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
        seen[i, torch.tensor(prompt_token_ids[i], dtype=torch.long, device=dev)] = True
    seen |= counts > 0
    rep = repetition.to(dev, torch.float32)[:, None].expand(B, V)  # [B, V]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)  # [B, V]
    logits.copy_(torch.where(seen, penalised, logits))
    logits -= frequency.to(dev, torch.float32)[:, None] * counts
    logits -= presence.to(dev, torch.float32)[:, None] * (counts > 0).float()
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit whose probability is below `min_p * max probability` of its row.

    logits: [B, V] float32; min_p: [B] float32 in [0, 1] (0 = off). Returns a new tensor.
    """
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = min_p.to(logits.device, torch.float32)[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep exactly the k largest logits per row, setting the rest to -inf.

    logits: [B, V] float32; k: [B] long, k <= 0 or k >= V disables the row. Ties at the
    boundary are broken as a stable sort would: among equal logits the lower token ids are
    kept, so exactly k ids survive. O(V) per row (`torch.topk` for the k-th value, no full
    sort). Returns a new tensor.
    """
    V = logits.shape[-1]
    k = k.to(logits.device, torch.long)
    k = torch.where((k <= 0) | (k > V), V, k)  # [B]
    kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])  # [B, 1] the k-th largest value
    above = logits > kth  # [B, V]
    tied = logits == kth  # [B, V]
    room = k[:, None] - above.sum(-1, keepdim=True)  # [B, 1] ties to keep, lowest ids first
    keep = above | (tied & (tied.cumsum(-1) <= room))
    return logits.masked_fill(~keep, float("-inf"))


def _top_p_keep_sorted(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """probs [B, N] sorted descending, p [B, 1] -> keep mask [B, N]: the mass strictly above
    each token is below p (the top-1 always kept); p >= 1 keeps all."""
    before = probs.cumsum(dim=-1) - probs  # [B, N] probability mass ranked above each token
    return (before < p) | (p >= 1.0)


def apply_top_p(logits: torch.Tensor, p: torch.Tensor, top_k: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the smallest set of most-probable tokens whose total probability reaches p.

    logits: [B, V] float32; p: [B] float32 in (0, 1], p >= 1 disables the row. A token is kept
    when the probability of all strictly higher-ranked tokens is below p, so the top-1 is always
    kept. Ties are ranked as by a stable sort (lower token id first). `top_k` [B] long: when
    every row has at most top_k finite logits (top-k applied first, 0 < top_k < V), only those
    candidates are sorted instead of the whole vocabulary. Returns a new tensor.
    """
    B, V = logits.shape
    p = p.to(logits.device, torch.float32)[:, None]  # [B, 1]
    probs = logits.softmax(dim=-1)  # [B, V]
    if top_k is not None and bool(((top_k > 0) & (top_k < V)).all()):
        cand = logits.topk(int(top_k.max()), dim=-1).indices.sort(dim=-1).values  # [B, K] ids ascending
        cand_probs = probs.gather(-1, cand)  # [B, K]
        cp, pos = torch.sort(cand_probs, dim=-1, descending=True, stable=True)  # ties: lower id first
        finite = torch.isfinite(logits.gather(-1, cand)).gather(-1, pos)  # [B, K] candidates top-k left
        keep_sorted = _top_p_keep_sorted(cp, p) & finite  # [B, K]
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, cand.gather(-1, pos), keep_sorted)
        return logits.masked_fill(~keep & (p < 1.0), float("-inf"))
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [B, V]
    keep = torch.empty_like(order, dtype=torch.bool).scatter_(-1, order, _top_p_keep_sorted(sorted_probs, p))
    return logits.masked_fill(~keep, float("-inf"))


def first_rows(logits: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """logits[starts] ([len(starts), V]): each sampling request's first row. Without drafts
    (one row each) the logits themselves, with no [B, V] copy (indexing took 22 ms a step at 64
    requests of a 152k vocabulary)."""
    return logits if len(starts) == len(logits) else logits[starts]


class Sampler:
    """Samples one token per row from [B, V] logits under per-request SamplingParams.

    Per row: logits_processors -> grammar mask -> raw logprobs -> logit_bias -> penalties -> argmax if greedy, else
    temperature -> min_p -> top_k -> top_p -> draw from the softmax with an exponential race
    (argmax of probs / Exp(1) noise). A row draws its noise from its own generator if given,
    so a seeded request's tokens do not depend on the rest of the batch; otherwise from the
    Sampler's generator, seeded with `seed`. Follows vLLM v1 vllm/v1/sample/sampler.py.
    """

    def __init__(self, seed: int = 0, device: torch.device = torch.device("cpu"), argmax_kernel: bool = False) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.argmax_kernel = argmax_kernel  # greedy argmax through the CPU kernel (`kernels/sampling.py`)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], prompt_token_ids: list[list[int]],
                 output_token_ids: list[list[int]], generators: list[torch.Generator | None],
                 grammars: Sequence[GrammarMatcher | None] = ()) -> SamplerOutput:
        """Sample one token per row.

        logits: [B, V] float32 (not modified). params, prompt_token_ids, output_token_ids,
        generators: length B each; `grammars`: per row, the structured-output matcher whose
        mask applies after the logits processors (before the raw logprobs), or None.
        Returns a SamplerOutput with B token ids.
        """
        B, V = logits.shape
        dev = logits.device
        penalized = any(sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0
                        for sp in params)
        processed = any(sp.logits_processors or sp.logit_bias for sp in params) or any(g is not None for g in grammars)
        # a private copy only when it is written to (a greedy batch just takes the argmax: the
        # copy of [B, V] float32 logits was 2 ms of a 66 ms decode step at B=16)
        logits = logits.to(torch.float32)
        if penalized or processed:
            logits = logits.clone()  # [B, V]
        errors: list[Exception | None] = [None] * B
        for i, sp in enumerate(params):
            if not sp.logits_processors:
                continue
            row = logits[i]
            try:
                for proc in sp.logits_processors:
                    row = proc(list(output_token_ids[i]), row)
                    if not isinstance(row, torch.Tensor) or row.shape != (V,):
                        raise TypeError(f"a logits processor must return a tensor of shape ({V},), got {row!r:.80}")
                logits[i] = row
            except Exception as e:  # a user callback: isolate its failure to its own request
                errors[i] = e

        rows = [i for i, g in enumerate(grammars) if g is not None]
        if rows:  # one batched mask for every constrained row
            type(grammars[rows[0]]).mask_rows([grammars[i] for i in rows], logits, rows)

        want_logprobs = any(sp.logprobs is not None for sp in params)
        raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None  # [B, V]

        def col(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)  # [B]

        for i, sp in enumerate(params):
            if sp.logit_bias:
                ids = torch.tensor(list(sp.logit_bias), dtype=torch.long, device=dev)
                logits[i].index_add_(0, ids, torch.tensor(list(sp.logit_bias.values()), dtype=torch.float32,
                                                          device=dev))

        if penalized:
            apply_penalties(logits, prompt_token_ids, output_token_ids,
                            col([sp.repetition_penalty for sp in params]),
                            col([sp.presence_penalty for sp in params]),
                            col([sp.frequency_penalty for sp in params]))

        greedy = col([sp.greedy for sp in params], torch.bool)  # [B]
        # max's indices: the first maximum, as argmax, in about 60% of argmax's time on CPU
        # (16 x 151936 float32 logits: 2.6 against 4.3 ms); the CPU kernel, the same indices
        # in a fifth of max's time
        token_ids = argmax_rows(logits) if self.argmax_kernel else logits.max(dim=-1).indices  # [B]
        if not bool(greedy.all()):
            temps = col([1.0 if sp.greedy else sp.temperature for sp in params])  # [B]
            scaled = logits / temps[:, None]  # [B, V]
            if any(sp.min_p > 0.0 for sp in params):
                scaled = apply_min_p(scaled, col([sp.min_p for sp in params]))
            top_k = None
            if any(sp.top_k > 0 for sp in params):
                top_k = col([max(sp.top_k, 0) for sp in params], torch.long)
                scaled = apply_top_k(scaled, top_k)
            if any(sp.top_p < 1.0 for sp in params):
                scaled = apply_top_p(scaled, col([sp.top_p for sp in params]), top_k)
            probs = scaled.softmax(dim=-1)  # [B, V]
            for i in range(B):
                if params[i].greedy:
                    continue
                gen = generators[i] if generators[i] is not None else self.generator
                noise = torch.empty(V, dtype=torch.float32, device=gen.device).exponential_(generator=gen)  # [V]
                noise = noise.to(dev).clamp_min_(torch.finfo(torch.float32).tiny)
                token_ids[i] = (probs[i] / noise).argmax()

        ids = token_ids.tolist()
        out_logprobs: list[list[tuple[int, float, int]] | None] = []
        for i, sp in enumerate(params):
            if sp.logprobs is None:
                out_logprobs.append(None)
                continue
            row = raw_logprobs[i]  # [V]
            chosen = row[ids[i]]
            entries = [(ids[i], chosen.item(), int((row > chosen).sum().item()) + 1)]
            top = row.topk(min(sp.logprobs, V))
            entries += [(t, lp, r + 1) for r, (t, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()))]
            out_logprobs.append(entries)
        return SamplerOutput(token_ids=ids, logprobs=out_logprobs, errors=errors)
