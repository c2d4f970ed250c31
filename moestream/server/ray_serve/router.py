"""Prefix-cache-affinity routing of moestream requests: Ray Serve's own
`PrefixCacheAffinityRouter` (ray.serve.llm.request_router; balance first, then the replica
whose earlier prompts match the longest prefix, above a match-rate threshold), reading the
prompt text from moestream's request models."""

from __future__ import annotations

from typing import Any

try:
    # The class `ray.serve.llm.request_router` exports, taken from where it is defined: the
    # public module also loads ray.llm's cloud-storage helpers, which need pyarrow.
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
except ImportError:  # another Ray version's layout
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter


def prompt_text(req: Any) -> str:
    """The text a request's prompt starts with, for prefix matching: a completion's prompt
    (token ids written out as numbers), or a chat's messages as role and text parts."""
    prompt = getattr(req, "prompt", None)
    if prompt is not None:
        if isinstance(prompt, str):
            return prompt
        if prompt and isinstance(prompt[0], str):
            return "".join(prompt)
        first = prompt[0] if prompt and isinstance(prompt[0], list) else prompt  # a batch: its first prompt
        return " ".join(str(t) for t in first)
    parts = []
    for m in getattr(req, "messages", None) or []:
        parts.append(f"<{m.role}>")
        if isinstance(m.content, str):
            parts.append(m.content)
        elif m.content:
            parts.extend(getattr(p, "text", "<image>") for p in m.content)
    return "".join(parts)


class PrefixAffinityRouter(PrefixCacheAffinityRouter):
    """`PrefixCacheAffinityRouter` over moestream's deployment calls, whose arguments are
    (kind, CompletionRequest | ChatCompletionRequest). Its kwargs (`imbalanced_threshold`:
    load difference above which the least loaded replica wins; `match_rate_threshold`: the
    least matched fraction of the prompt's characters worth following) pass through.

    Load is counted here, per replica, from the routing decisions themselves: requests routed
    to it and not completed (`on_request_completed`). Ray's queue-length cache is updated
    only once a request is sent, so in a burst every decision saw both replicas at 0 and
    the tie always went to the first: 16 concurrent unrelated prompts all landed on one
    replica. Among the replicas the parent ranks first (the prefix match, or the tenants
    with the least cached text) the least loaded wins, and a choice more than
    `imbalanced_threshold` requests above the least loaded replica gives way to it. A call
    without a prompt (/detokenize, /tokenizer_info) goes to the least loaded replica: the
    parent divides by the prompt's length, and its error left the request waiting forever.
    """

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._assigned: dict[Any, int] = {}  # replica id -> requests routed to it, not completed
        self._choice: dict[str, Any] = {}  # internal request id -> the replica it was routed to

    def _extract_text_from_request(self, pending_request: Any) -> str | None:
        for arg in pending_request.args:
            if hasattr(arg, "prompt") or hasattr(arg, "messages"):
                return prompt_text(arg)
        return None  # no prompt (/detokenize, /tokenizer_info): nothing to remember (`on_request_routed`)

    def _release(self, request_id: str) -> None:
        replica = self._choice.pop(request_id, None)
        if replica is not None:
            self._assigned[replica] = max(0, self._assigned.get(replica, 0) - 1)

    async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None) -> list:
        if pending_request is not None and not any(hasattr(a, "prompt") or hasattr(a, "messages")
                                                   for a in pending_request.args):
            ranks = [list(candidate_replicas)]  # no prompt to follow (/detokenize, /tokenizer_info): the least loaded
        else:
            ranks = await super().choose_replicas(candidate_replicas, pending_request)
        first = next((r for r in ranks if r), None)
        if not first or pending_request is None:
            return ranks
        request_id = pending_request.metadata.internal_request_id
        self._release(request_id)  # chosen again (retry, rejection): its earlier choice is void

        def load(replica: Any) -> int:
            return self._assigned.get(replica.replica_id, 0)

        best = min(first, key=load)  # the first of equals: the parent's order is kept
        least = min(candidate_replicas, key=load)
        if load(best) - load(least) > self._imbalanced_threshold:
            best = least
        self._assigned[best.replica_id] = load(best) + 1
        self._choice[request_id] = best.replica_id
        return [[best]] + [r for r in ranks if r]  # the rest stay as fallbacks (best full: rejected)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self._release(internal_request_id)
