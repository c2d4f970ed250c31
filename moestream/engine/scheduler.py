"""Token-budget scheduler with chunked prefill, recompute preemption and abort.

Follows vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py): no prefill/decode phases.
Each step, running requests are served first, each taking min(tokens left to compute,
budget left). When the KV pool cannot hold a request's next tokens, the newest running
request not yet scheduled this step is preempted: its blocks and state are freed, its
computed count reset to 0, and it goes back to the front of the waiting queue, to be
recomputed later (with elastic memory, the expert store first gives up slots as KV blocks,
and gets them back once nobody waits). Waiting requests are admitted while the budget, `max_num_seqs` and blocks
allow, and only in a step that preempted nothing; with prefix caching, an admitted request
starts after the longest usable cached prefix of its tokens (`KVCacheCoordinator.find_prefix`).

The scheduler alone decides which requests run: on a hybrid model a step runs at most
`max_states` requests (the device state slots), so when more than that are running or
admissible (up to `max_num_seqs`) they take turns, least recently run (or longest waiting)
first, and the coordinator swaps their states in before the step (`prepare_states`). The
runner runs exactly what it is given, in one forward.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from moestream.engine.kv_cache_coordinator import KVCacheCoordinator, StatePlan
from moestream.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What to run this step: `scheduled[i]` = (request, number of new tokens to compute);
    `states`: hybrid models' state slots and checkpoint captures for them."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    states: StatePlan | None = None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Owns the waiting queue and the running list; all cache state goes through the
    `KVCacheCoordinator`."""

    def __init__(self, coordinator: KVCacheCoordinator, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.coordinator = coordinator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._turns: OrderedDict[str, None] = OrderedDict()  # round-robin order: next turn first

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self._turns[request.request_id] = None

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        cap = self.coordinator.max_states or self.max_num_seqs
        admissible = list(self.waiting)[: max(self.max_num_seqs - len(self.running), 0)]
        order = self.running + admissible
        if len(order) > cap:  # take turns (round robin): least recently run or longest waiting first
            turn = {rid: i for i, rid in enumerate(self._turns)}
            order.sort(key=lambda r: turn[r.request_id])
        chosen: set[str] = set()
        admitting = True
        for req in order:
            if budget <= 0 or len(out.scheduled) >= cap:
                break
            if req.status is RequestStatus.RUNNING:
                if req.spec_token_ids and req.num_computed_tokens != req.num_tokens - 1:
                    req.spec_token_ids = []  # drafts only ride on a decode
                n = min(req.num_tokens - req.num_computed_tokens + len(req.spec_token_ids), budget)
                del req.spec_token_ids[max(n - 1, 0):]  # drafts count against the token budget
                while not self.coordinator.allocate_slots(req, req.num_computed_tokens + n, may_grow=True):
                    victim = next(r for r in reversed(self.running) if r.request_id not in chosen)
                    self.running.remove(victim)
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is req:
                        break
                else:
                    out.scheduled.append((req, n))
                    chosen.add(req.request_id)
                    budget -= n
                    continue
                break
            elif admitting and not out.preempted and req is self.waiting[0]:
                hit = self.coordinator.find_prefix(req)  # None: its cartridges do not fit yet
                n = min(req.num_tokens - hit.num_tokens, budget) if hit is not None else 0
                if hit is None or not self.coordinator.allocate_slots(req, hit.num_tokens + n, hit):
                    self.coordinator.cancel_prefix(req)
                    admitting = False  # FIFO: nobody behind it is admitted this step
                    continue
                self.coordinator.admit(req, hit)
                if req.num_cached_tokens is None:  # prompt tokens cached beyond its cartridges
                    req.num_cached_tokens = hit.num_tokens - req.num_prefix_tokens
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append((req, n))
                chosen.add(req.request_id)
                budget -= n
        for req, _ in out.scheduled:
            self._turns.move_to_end(req.request_id)
        if not self.waiting:  # KV demand fell: elastic memory gives borrowed pages back
            self.coordinator.release_kv(reserve_blocks=len(self.running))
        if out.scheduled:
            out.states = self.coordinator.prepare_states(out.scheduled)
        return out

    def _preempt(self, req: Request) -> None:
        self.coordinator.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def reset_request(self, req: Request) -> None:
        """Drop `req`'s computed tokens (blocks and state) so that it is recomputed from token 0;
        it keeps its place in the queues. A running request with cartridges goes back to the
        front of the waiting queue instead, to be admitted after them again."""
        if req.cartridge is not None and req in self.running:
            self.running.remove(req)
            self._preempt(req)
            return
        self.coordinator.free(req)
        req.num_computed_tokens = 0

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Mark `req` finished with `status`, remove it from the queues and free its blocks."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._turns.pop(req.request_id, None)
        self.coordinator.free(req)
        if not self.waiting:  # KV demand fell: elastic memory gives borrowed pages back
            self.coordinator.release_kv(reserve_blocks=len(self.running))

    def update_from_output(self, sched: SchedulerOutput, samplers: list[Request],
                           finished: dict[int, RequestStatus]) -> list[Request]:
        """The step's update (vLLM v1's `update_from_output`): each scheduled request's
        progress, the coordinator's commit of the step's blocks and states, and the finish
        of `finished` ({index in samplers: status}). A request that sampled has computed all
        its tokens but the last one sampled (the KV of rejected draft positions is left to be
        overwritten); its drafts are spent. Returns the requests finished, in samplers' order."""
        sampled = {id(r) for r in samplers}
        for req, n in sched.scheduled:
            req.num_computed_tokens = req.num_tokens - 1 if id(req) in sampled else req.num_computed_tokens + n
            req.spec_token_ids = []
        self.coordinator.commit(sched.scheduled)
        done = []
        for i in sorted(finished):
            self.finish_request(samplers[i], finished[i])
            done.append(samplers[i])
        return done
