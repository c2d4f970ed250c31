"""Speculative decoding's side of the engine: who drafts how many tokens next (with adaptive
k), the draft passes (n-gram lookup, `draft_experts`, MTP), the verdict on each verified row
(`observe`, for `verifier.accept_tokens`) and vLLM's SpecDecoding counters."""

from __future__ import annotations

import logging
import time

from moestream.config import SpeculativeConfig
from moestream.engine.kv_cache_coordinator import KVCacheCoordinator
from moestream.engine.model_runner import ModelRunner
from moestream.engine.request import Request
from moestream.engine.scheduler import Scheduler
from moestream.spec_decode.adaptive import AdaptiveK
from moestream.spec_decode.draft_experts import draft_pass
from moestream.spec_decode.mtp import mtp_draft
from moestream.spec_decode.ngram import NgramProposer

logger = logging.getLogger(__name__)

# Seconds between the speculative decoding acceptance log lines (vLLM logs every 10 s).
_SPEC_LOG_INTERVAL = 10.0


# `LLMEngine.spec_decode_stats` of an engine without speculative decoding
DISABLED_STATS = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": [],
                  "acceptance_rate": 0.0, "mean_acceptance_length": 0.0, "enabled": False}

class Speculator:
    """Drafts for the requests that go on, and the acceptance counters (vLLM's names).

    `proposer`: the n-gram proposer (method "ngram"; tests may put a scripted one here).
    `adaptive`: per-request draft lengths from measured acceptance and step costs
    (`AdaptiveK`), or None (k fixed).
    """

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, coordinator: KVCacheCoordinator,
                 scheduler: Scheduler, max_model_len: int) -> None:
        self.config, self.runner, self.coordinator, self.scheduler = config, runner, coordinator, scheduler
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config) if config.method == "ngram" else None
        self.adaptive = AdaptiveK(config.num_speculative_tokens) if config.adaptive else None
        self.stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                      "num_accepted_tokens_per_pos": [0] * config.num_speculative_tokens}
        self._log_time = time.monotonic()
        self._log_drafts = 0
        logger.info("speculative decoding: %s", config)

    def observe(self, req: Request, j: int, token: int) -> bool:
        """Row j of `req`'s verify sampled `token`: count the draft (at j = 0) and whether
        token equals draft j; feed adaptive k its verdicts (and a zero-length request's
        shadow draft). Returns whether draft j is accepted."""
        draft = req.spec_token_ids
        if j == 0 and draft:
            self.stats["num_drafts"] += 1
            self.stats["num_draft_tokens"] += len(draft)
        accepted = j < len(draft) and token == draft[j]
        if accepted:
            self.stats["num_accepted_tokens"] += 1
            self.stats["num_accepted_tokens_per_pos"][j] += 1
        state = req.draft_state
        if state is not None and self.adaptive is not None:
            if j < len(draft) and (not accepted or j + 1 == len(draft)):  # this verify is judged
                self.adaptive.observe(state, len(draft), j + accepted)
            elif not draft and state.shadow:  # would the shadow draft have been accepted?
                self.adaptive.observe(state, 1, int(token == state.shadow[0]))
            state.shadow = []
        return accepted

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """A decode-only step of `num_tokens` took `seconds` (adaptive k's cost model)."""
        if self.adaptive is not None:
            self.adaptive.cost.record(num_tokens, seconds)

    def draft_length(self, req: Request) -> int:
        """How many tokens `req` drafts next: at most num_speculative_tokens and what its
        max_tokens and max_model_len leave room for after the token the step samples; with
        adaptive k at most its current draft length (`AdaptiveK`), where length 0 sets a
        one-token shadow draft (n-gram, which costs nothing) to keep its acceptance measured."""
        sc = self.config
        room = min(sc.num_speculative_tokens, self.max_model_len - req.num_tokens - 1)
        if req.sampling_params.max_tokens is not None:
            room = min(room, req.sampling_params.max_tokens - req.num_output_tokens - 1)
        if room < 1 or self.adaptive is None:
            return max(room, 0)
        state = req.draft_state
        if state is None:
            state = req.draft_state = self.adaptive.new_state()
        before = state.k
        k = self.adaptive.choose(state, len(self.scheduler.running))
        if k == 0:
            if before > 0:
                logger.info("request %s: measured acceptance %.2f per drafted position makes drafting slower than "
                            "plain decode (a draft token costs %.2f of a decode token's time): k %d -> 0, drafts "
                            "resume when they start to match", req.request_id, state.acceptance,
                            self.adaptive.cost_ratio(len(self.scheduler.running)), before)
            if sc.method == "ngram":
                state.shadow = self.proposer.propose(req.token_ids[req.num_prefix_tokens:], 1)
            elif state.probe():  # a draft costs a forward: measure with one token now and then
                return 1
            return 0
        if before == 0:
            logger.info("request %s: measured acceptance %.2f: drafting again, k 0 -> %d", req.request_id,
                        state.acceptance, k)
        return min(room, k)

    def propose(self, reqs: list[Request], alive: list[Request]) -> None:
        """Set the draft tokens of the requests that go on (`reqs`: they sampled this step) in
        `spec_token_ids`, for their next step: n-gram lookups, one batched greedy draft pass
        over resident experts (`draft_experts`), or the MTP pass (`mtp`), which also runs over
        the step's other unfinished requests (`alive`: prefill chunks) to keep its KV cache
        complete. A draft that fails is dropped with an error log: drafts are an optimisation,
        never a reason to fail requests."""
        if not reqs and self.runner.mtp is None:
            return
        lengths = [self.draft_length(r) for r in reqs]
        method = self.config.method
        if method == "ngram":
            for req, n in zip(reqs, lengths):
                req.spec_token_ids = self.proposer.propose(req.token_ids[req.num_prefix_tokens:], n) if n else []
            return
        if method == "mtp":
            want = {id(r): n for r, n in zip(reqs, lengths)}
            mtp_lengths = []
            for req in alive:  # blocks for the chained drafts' own KV positions, or one draft only
                n = want.get(id(req), 0)
                if n >= 2 and not self.coordinator.allocate_slots(req, req.num_tokens + n - 2):
                    n = 1
                mtp_lengths.append(n)
            t0 = time.perf_counter()
            try:
                drafts = mtp_draft(self.runner, alive, mtp_lengths, self.coordinator)
            except Exception:
                logger.exception("MTP pass failed; these requests go on without drafts")
                return
            if self.adaptive is not None:
                self.adaptive.record_draft(max(sum(mtp_lengths), 1), time.perf_counter() - t0)
            for req, d in zip(alive, drafts):
                req.spec_token_ids = d
            return
        for i, req in enumerate(reqs):  # blocks for the drafted positions, or no draft
            if lengths[i] and not self.coordinator.allocate_slots(req, req.num_tokens - 1 + lengths[i]):
                lengths[i] = 0
        todo = [i for i, n in enumerate(lengths) if n]
        if not todo:
            return
        t0 = time.perf_counter()
        try:
            drafts = draft_pass(self.runner, [reqs[i] for i in todo], [lengths[i] for i in todo], self.coordinator)
        except Exception:
            logger.exception("draft pass failed; these requests go on without drafts")
            return
        if self.adaptive is not None:
            self.adaptive.record_draft(sum(lengths[i] for i in todo), time.perf_counter() - t0)
        for i, d in zip(todo, drafts):
            reqs[i].spec_token_ids = d

    def maybe_log(self, now: float) -> None:
        """Log the acceptance since the last log (vLLM's SpecDecoding metrics line), at most
        every `_SPEC_LOG_INTERVAL` seconds and only after drafts."""
        if now - self._log_time < _SPEC_LOG_INTERVAL:
            return
        st = self.stats_dict()
        if st["num_drafts"] == self._log_drafts:
            return
        per_pos = [a / st["num_drafts"] for a in st["num_accepted_tokens_per_pos"]]
        logger.info("speculative decoding: mean acceptance length %.2f, acceptance rate %.1f%%, per-position "
                    "acceptance %s, %d drafts (totals)", st["mean_acceptance_length"], 100 * st["acceptance_rate"],
                    "[" + ", ".join(f"{x:.2f}" for x in per_pos) + "]", st["num_drafts"])
        self._log_time, self._log_drafts = now, st["num_drafts"]

    def stats_dict(self) -> dict:
        """The counters (see `LLMEngine.spec_decode_stats`)."""
        st = dict(self.stats)
        st["num_accepted_tokens_per_pos"] = list(st["num_accepted_tokens_per_pos"])
        if self.adaptive is not None:
            st["step_cost_ratio"] = self.adaptive.cost_ratio(1)
        st["acceptance_rate"] = st["num_accepted_tokens"] / st["num_draft_tokens"] if st["num_draft_tokens"] else 0.0
        st["mean_acceptance_length"] = 1 + st["num_accepted_tokens"] / st["num_drafts"] if st["num_drafts"] else 0.0
        st["enabled"] = True
        return st
