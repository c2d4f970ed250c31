"""Token-budget scheduler with chunked prefill, recompute preemption and abort.

Follows vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py): no prefill/decode phases.
Each step, running requests are served first in arrival order, each taking
min(tokens left to compute, budget left). When the KV pool cannot hold a request's next
tokens, the newest running request is preempted: its blocks are freed, its computed count
reset to 0, and it goes back to the front of the waiting queue, to be recomputed later.
Waiting requests are admitted while the budget, `max_num_seqs` and blocks allow, and only
in a step that preempted nothing; with prefix caching, an admitted request starts after the
longest cached prefix of its tokens (`KVCacheManager.get_computed_blocks`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from moestream.engine.kv_cache import KVCacheManager
from moestream.engine.request import Request, RequestStatus
from moestream.engine.state_pool import StatePool


@dataclass
class SchedulerOutput:
    """What to run this step: `scheduled[i]` = (request, number of new tokens to compute)."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Owns the waiting queue, the running list and the KV block manager. With a hybrid
    model's `state_pool`, a preempted or finished request's linear-attention state is
    dropped along with its blocks."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        state_pool: StatePool | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.state_pool = state_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(req.request_id, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, n))
                budget -= n
                i += 1
                continue
            break
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # A waiting request has nothing computed; its longest cached prefix is not recomputed.
            hits = self.kv_cache.get_computed_blocks(req.request_id, req.token_ids)
            num_hit = len(hits) * self.kv_cache.block_size
            n = min(req.num_tokens - num_hit, budget)
            if not self.kv_cache.allocate_slots(req.request_id, num_hit + n, hits):
                break
            self.kv_cache.record_query(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_hit
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
        return out

    def _free(self, req: Request) -> None:
        self.kv_cache.free(req.request_id)
        if self.state_pool is not None:
            self.state_pool.free(req.request_id)

    def _preempt(self, req: Request) -> None:
        self._free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def reset_request(self, req: Request) -> None:
        """Drop `req`'s computed tokens (blocks and state) so that it is recomputed from token 0;
        it keeps its place in the queues."""
        self._free(req)
        req.num_computed_tokens = 0

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Mark `req` finished with `status`, remove it from the queues and free its blocks."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free(req)
