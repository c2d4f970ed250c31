"""Batch preparation and the forward pass: turns a SchedulerOutput into flat tensors,
runs the model once over the paged KV cache (and, for hybrid models, the state slots the
scheduler made resident), and returns the logits of the requests that finished computing
all their tokens this step (those sample a token)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from moestream.engine.kv_cache import slot_of
from moestream.engine.kv_cache_coordinator import KVCacheCoordinator
from moestream.engine.prompt_logprobs import PromptLogprobsChunk, compute_prompt_logprobs, prompt_logprob_spans
from moestream.engine.request import Request
from moestream.engine.scheduler import SchedulerOutput
from moestream.engine.state_pool import StatePool
from moestream.experts.expert_mode import ExpertMode
from moestream.experts.trace import RoutingRecorder
from moestream.layers.attention_backend import AttentionMetadata
from moestream.layers.recurrent_state import StateMetadata
from moestream.models.moe_decoder import MoEForCausalLM
from moestream.multimodal.vision import VisionEncoder

LOGITS_BUFFER_MAX_BYTES = 256 << 20
"""The most memory the runner's logits buffer may hold (bytes): 256 MiB, 441 rows of a
151936-token vocabulary."""


class ModelRunner:
    """Owns the model and the KV cache tensors: per attention layer (k, v), each
    [num_blocks, block_size, heads, dim] in the model dtype, with (heads, k dim, v dim) the
    config's `kv_cache_dims` (MLA: one latent head and an empty v). With several KV cache
    groups, attention layer a uses tensor `layer_tensor[a]`, its rank in its group: one
    layer of each group shares a tensor, and a block id belongs to one group at a time. Linear-attention
    layers have no KV cache; their states are the `state_pool`'s.

    The runner decides nothing: the scheduler output names the requests, their token
    counts and (hybrid models) their state slots and checkpoint captures; block tables are
    read from the coordinator.

    With a routing `recorder`, each forward first names its rows to it (`begin_step`): row i
    of the flat batch [T] is token `positions[i]` of its request, so the MoE layers' records
    of that forward ([T, k] expert ids) land on the right (request, position).

    Multimodal prompts (`Request.mm_inputs`): the `vision` encoder computes an image's
    embeddings when its first placeholder token is scheduled (kept on the request until its
    last one is computed, so a chunked prefill may split an image), and they replace the
    placeholders' token embeddings. Rotary positions are [3, T] M-RoPE positions in a step
    that computes prompt tokens of a multimodal request, else [T]; a multimodal request's
    tokens past its prompt sit at p + its rope delta.
    """

    def __init__(
        self,
        model: MoEForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        state_pool: StatePool | None = None,
        recorder: RoutingRecorder | None = None,
        mtp: nn.Module | None = None,
        vision: VisionEncoder | None = None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        layer_tensor: list[int] | None = None,
    ) -> None:
        cfg = model.config
        self.vision = vision
        self.model = model
        self.device = device
        self.block_size = block_size
        self.state_pool = state_pool
        self.recorder = recorder
        self.expert_mode: ExpertMode | None = None  # an approximate expert mode (set by the builder)
        heads, k_dim, v_dim = cfg.kv_cache_dims
        num_layers = len(cfg.attention_layers)
        if layer_tensor is None:
            layer_tensor = list(range(num_layers))
        if kv_caches is None:  # else given: an elastic memory pool's views, the MTP layer's last
            kv_caches = [(torch.zeros((num_blocks, block_size, heads, k_dim), dtype=dtype, device=device),
                          torch.zeros((num_blocks, block_size, heads, v_dim), dtype=dtype, device=device))
                         for _ in range(max(layer_tensor, default=-1) + 1 + (mtp is not None))]
        num_tensors = max(layer_tensor, default=-1) + 1
        # attention layer a reads and writes tensor layer_tensor[a] (shared by one layer of each KV cache group)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [kv_caches[t] for t in layer_tensor]
        self.mtp = mtp  # speculative method "mtp": the checkpoint's MTP layer, with its own KV cache
        self.mtp_kv = kv_caches[num_tensors] if mtp is not None else None
        self.last_hidden: torch.Tensor | None = None
        self.last_rows: dict[str, tuple[int, int]] = {}
        self.prompt_logprobs: list[PromptLogprobsChunk] = []  # the last step's, for the update phase
        # the sampled rows' logits are written into this buffer, kept across steps (CPU): a new
        # [64, 151936] float32 tensor is freshly mapped memory, ~7 ms of page faults a step
        self._logits_buffer = torch.empty(0, dtype=torch.float32, device=device)

    def attention_metadata(self, qsl: list[int], seq_lens: list[int], tables: list[list[int]],
                            slots: list[int], sliding: AttentionMetadata | None = None) -> AttentionMetadata:
        """Attention metadata of a flat batch: request i owns rows [qsl[i], qsl[i+1]), sees
        seq_lens[i] tokens through block table tables[i]; row r's KV goes to slots[r].
        `sliding`: the sliding-window group's metadata, on a model with two groups."""
        dev = self.device
        width = max(len(t) for t in tables)
        return AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
            sliding=sliding,
        )

    def batch_metadata(self, coordinator: KVCacheCoordinator, spans: list[tuple[str, int, int]]) -> AttentionMetadata:
        """Attention metadata of a flat batch whose rows are, in order, the positions
        [start, end) of each (request id, start, end), each request seeing `end` tokens,
        with the block tables of every KV cache group (a second group: `sliding`)."""
        qsl = [0]
        for _, start, end in spans:
            qsl.append(qsl[-1] + end - start)
        seq_lens = [end for _, _, end in spans]
        metas = []
        for g in range(len(coordinator.groups)):
            tables = [coordinator.groups[g].block_table(rid) for rid, _, _ in spans]
            slots = [slot_of(t, p, self.block_size) for t, (_, start, end) in zip(tables, spans)
                     for p in range(start, end)]
            metas.append((tables, slots))
        sliding = self.attention_metadata(qsl, seq_lens, *metas[1]) if len(metas) > 1 else None
        return self.attention_metadata(qsl, seq_lens, *metas[0], sliding=sliding)

    def rope_positions(self, spans: list[tuple[Request, int, int]]) -> torch.Tensor:
        """Rotary positions of a flat batch whose rows are, in order, the token indices
        [start, end) of each (request, start, end): [T] int64, or [3, T] (M-RoPE) when a
        multimodal request has prompt tokens among them."""
        if not any(r.mm_inputs is not None and start < r.num_prompt_tokens for r, start, _ in spans):
            flat: list[int] = []
            for r, start, end in spans:
                delta = r.mm_inputs.mrope_delta if r.mm_inputs is not None else 0
                flat.extend(range(start + delta, end + delta))
            return torch.tensor(flat, dtype=torch.int64, device=self.device)  # [T]
        parts = []
        for r, start, end in spans:
            if r.mm_inputs is None:
                parts.append(torch.arange(start, end).expand(3, -1))
                continue
            num_prompt, delta = r.num_prompt_tokens, r.mm_inputs.mrope_delta
            parts.append(r.mm_inputs.mrope_positions[:, start:min(end, num_prompt)])
            if end > num_prompt:
                parts.append(torch.arange(max(start, num_prompt) + delta, end + delta).expand(3, -1))
        return torch.cat(parts, dim=1).to(self.device)  # [3, T]

    def _inputs_embeds(self, ids: torch.Tensor, spans: list[tuple[Request, int, int]]) -> torch.Tensor | None:
        """Input embeddings [T, H] with the vision embeddings of the images whose placeholder
        tokens are in the batch (rows as in `_rope_positions`); None when there are none.
        An image is encoded once, when its first token is scheduled, and its embeddings are
        dropped once its last token is."""
        rows: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        row = 0
        for r, start, end in spans:
            if r.mm_inputs is not None and start < r.num_prompt_tokens:
                for i, item in enumerate(r.mm_inputs.items):
                    lo, hi = max(start, item.offset), min(end, item.end)
                    if lo >= hi:
                        continue
                    emb = r.mm_embeds.get(i)
                    if emb is None:
                        assert self.vision is not None, "a multimodal request on a model without a vision tower"
                        emb = r.mm_embeds[i] = self.vision.encode(item)  # [length, H]
                    embeds.append(emb[lo - item.offset:hi - item.offset])
                    rows.append(torch.arange(row + lo - start, row + hi - start))
                    if hi == item.end:
                        del r.mm_embeds[i]
            row += end - start
        if not rows:
            return None
        x = self.model.model.embed_tokens(ids)  # [T, H]
        x[torch.cat(rows).to(self.device)] = torch.cat(embeds).to(x.dtype)
        return x

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache tensors (all full-attention layers, and the MTP layer's)."""
        caches = self.kv_caches + ([self.mtp_kv] if self.mtp_kv is not None else [])
        unique = {id(k): (k, v) for k, v in caches}.values()  # groups share tensors
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in unique)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, coordinator: KVCacheCoordinator
                ) -> tuple[list[Request], torch.Tensor, list[int]]:
        """Run one step in one forward. Returns (requests that sample now, their logits [R, V]
        float32, rows per request): a request with k draft tokens (`spec_token_ids`, inputs
        after its last token) has 1 + k rows, one per position to verify; others have 1.
        The prompt logprobs the step computed are left in `prompt_logprobs`.

        Raises:
            ValueError: a hybrid model's step without a state plan.
        """
        scheduled = sched.scheduled
        if self.state_pool is not None and sched.states is None:
            raise ValueError("a hybrid model's step needs the scheduler's state plan")
        input_ids: list[int] = []
        positions: list[int] = []
        qsl = [0]
        sample_rows: list[int] = []
        samplers: list[Request] = []
        num_rows: list[int] = []
        for req, n in scheduled:
            start = req.num_computed_tokens
            draft = req.spec_token_ids
            input_ids.extend((req.token_ids + draft if draft else req.token_ids)[start : start + n])
            positions.extend(range(start, start + n))
            qsl.append(qsl[-1] + n)
            if start + n == req.num_tokens + len(draft):  # its last token and any drafts: sample each
                sample_rows.extend(range(qsl[-1] - 1 - len(draft), qsl[-1]))
                num_rows.append(1 + len(draft))
                samplers.append(req)
        dev = self.device
        meta = self.batch_metadata(coordinator, [(r.request_id, r.num_computed_tokens, r.num_computed_tokens + n)
                                                 for r, n in scheduled])
        state_caches, state_meta = None, None
        if self.state_pool is not None:
            plan = sched.states
            state_caches = self.state_pool.caches()
            state_meta = StateMetadata(qsl, plan.slots, torch.tensor(plan.slots, dtype=torch.int64, device=dev),
                                       plan.captures)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)  # [T]
        spans = [(r, r.num_computed_tokens, r.num_computed_tokens + n) for r, n in scheduled]
        if any(r.mm_inputs is not None for r, _ in scheduled):
            pos = self.rope_positions(spans)  # [T] or [3, T]
        else:  # text only: the token positions themselves
            pos = torch.tensor(positions, dtype=torch.int64, device=dev)  # [T]
        if self.recorder is not None:
            self.recorder.begin_step([r.request_id for r, n in scheduled for _ in range(n)], positions)
        mode = self.expert_mode
        if mode is not None:  # the rows of requests in the engine's approximate mode (not opted out with "exact")
            rows = [(r.sampling_params.expert_mode or mode.name) != "exact" for r, n in scheduled for _ in range(n)]
            if any(rows):  # prompt rows: the prompt, and outputs recomputed after a preemption (successor known)
                prompt = [r.num_computed_tokens + i < max(r.num_prompt_tokens, len(r.token_ids) - 1)
                          for r, n in scheduled for i in range(n)]
                mode.begin_step(np.array(rows), np.array(prompt))
            else:
                mode.begin_step(None)
        try:
            hidden = self.model(ids, pos, self.kv_caches, meta, state_caches, state_meta,
                                inputs_embeds=self._inputs_embeds(ids, spans))  # [T, H]
        finally:
            if mode is not None:
                mode.begin_step(None)  # other forwards (drafts, MTP) run exact
        lp_spans = prompt_logprob_spans(scheduled)
        self.prompt_logprobs = compute_prompt_logprobs(hidden, self.model.compute_logits, lp_spans) if lp_spans else []
        if self.mtp is not None:  # the MTP pass reads every row's hidden state after the update
            self.last_hidden = hidden
            self.last_rows = {r.request_id: (r.num_computed_tokens, qsl[i]) for i, (r, _) in enumerate(scheduled)}
        if not samplers:
            return [], hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32), []
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=dev)
        return samplers, self.model.compute_logits(hidden[rows], self._logits_out(len(sample_rows))), num_rows

    def _logits_out(self, n: int) -> torch.Tensor | None:
        """A float32 [n, V] view of the logits buffer (grown as needed, up to
        `LOGITS_BUFFER_MAX_BYTES`), or None (a new tensor: off CPU, or past the cap). The view
        is valid until the next step's logits overwrite it: the engine samples and updates
        from it within the step."""
        vocab = self.model.config.vocab_size
        if self.device.type != "cpu" or n * vocab * 4 > LOGITS_BUFFER_MAX_BYTES:
            return None
        if self._logits_buffer.numel() < n * vocab:
            self._logits_buffer = torch.empty(n * vocab, dtype=torch.float32, device=self.device)
        return self._logits_buffer[: n * vocab].view(n, vocab)
