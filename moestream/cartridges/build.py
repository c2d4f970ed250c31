"""Cartridge builders that read the engine's own KV cache: `prefix` and `knorm`.

- `prefix`: the exact cache entries of a document (p = its length), read from the paged KV
  cache after the engine prefilled it, plus (hybrid models) the linear layers' states after
  its last token. A request starting after it computes what it would compute with the
  document prepended: it is the ground truth the other builders are measured against, and a
  prefix cache that survives restarts. With `after`, the document is prefilled after those
  cartridges, so the new one continues them (`position_offset`, `base`): composing them in
  order is exact, on every model.
- `knorm`: a drop heuristic. Of the document's entries, each layer and KV head keeps the p
  whose keys have the smallest L2 norm (Devoto et al. 2024, "A Simple and Effective L2
  Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430), in document order.
  Kept keys keep the rotary positions they were computed at; the request's tokens still
  follow at p, p+1, ... The linear layers' states are the whole document's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moestream.cartridges.format import Cartridge, CartridgeError, model_fingerprint
from moestream.engine.llm_engine import LLMEngine
from moestream.sampling_params import SamplingParams


def read_entries(engine: LLMEngine, request_id: str, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per attention layer, the cache entries of positions [start, end) of a running request:
    keys [end - start, heads, k_dim] and values [end - start, heads, v_dim] (host copies)."""
    bs = engine.config.block_size
    table = engine.coordinator.block_table(request_id)
    pos = torch.arange(start, end)
    blocks = torch.tensor(table, dtype=torch.int64)[pos // bs]
    offsets = pos % bs
    keys = [k[blocks, offsets].cpu().clone() for k, _ in engine.runner.kv_caches]
    values = [v[blocks, offsets].cpu().clone() for _, v in engine.runner.kv_caches]
    return keys, values


def prefill_document(engine: LLMEngine, token_ids: Sequence[int], after: Sequence[str | dict] = ()
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], int]:
    """Prefill `token_ids` (after the cartridges `after`) and read back what a cartridge holds:
    (keys, values per attention layer [len, heads, dim], the linear layers' states after the
    last token (`StatePool.read_row` order, [] on attention-only models), the position of the
    first token)."""
    prompt: dict = {"prompt_token_ids": list(token_ids)}
    if after:
        prompt.update(cartridges=list(after), cartridge_routing="always")
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    req = engine.requests[rid]
    try:
        while req.num_computed_tokens < req.num_prompt_tokens:
            engine.step()
        start = req.num_prefix_tokens
        keys, values = read_entries(engine, rid, start, req.num_prompt_tokens)
        states = []
        if engine.state_pool is not None:
            states = [t.clone() for t in engine.state_pool.read_row(engine.state_pool.slot_of(rid))]
        return keys, values, states, start
    finally:
        engine.abort_request(rid)


def build_prefix(engine: LLMEngine, token_ids: Sequence[int], cartridge_id: str,
                 after: Sequence[str | dict] = ()) -> Cartridge:
    """The `prefix` cartridge of document `token_ids` (see the module docstring).

    Raises:
        CartridgeError: an empty document, or `after` cartridges that are refused.
    """
    if not token_ids:
        raise CartridgeError("the document is empty")
    keys, values, states, start = prefill_document(engine, token_ids, after)
    base, base_digest = "", ""
    if after:
        last = engine.input_processor.cartridges.compose(list(after)).parts[-1]
        base, base_digest = last.id, last.digest
    return Cartridge(cartridge_id, len(token_ids), model_fingerprint(engine.config.model), "prefix", tuple(keys),
                     tuple(values), tuple(states), start, base, tuple(int(t) for t in token_ids),
                     builder_args={"after": [a if isinstance(a, str) else a.get("id") or a.get("path")
                                             for a in after]}, base_digest=base_digest)


def build_knorm(engine: LLMEngine, token_ids: Sequence[int], num_tokens: int, cartridge_id: str) -> Cartridge:
    """The `knorm` cartridge of `num_tokens` positions of document `token_ids`.

    Raises:
        CartridgeError: `num_tokens` outside [1, len(token_ids)].
    """
    if not 1 <= num_tokens <= len(token_ids):
        raise CartridgeError(f"--num-tokens must be in [1, {len(token_ids)}] (the document's length), got {num_tokens}")
    keys, values, states, _ = prefill_document(engine, token_ids)
    kept_k, kept_v = [], []
    for k, v in zip(keys, values):
        norms = k.float().norm(dim=-1)  # [n, heads]
        idx = norms.topk(num_tokens, dim=0, largest=False).indices.sort(dim=0).values  # [p, heads], in order
        kept_k.append(k.gather(0, idx[:, :, None].expand(-1, -1, k.shape[-1])))
        kept_v.append(v.gather(0, idx[:, :, None].expand(-1, -1, v.shape[-1])))
    return Cartridge(cartridge_id, num_tokens, model_fingerprint(engine.config.model), "knorm", tuple(kept_k),
                     tuple(kept_v), tuple(states), builder_args={"document_tokens": len(token_ids)})
