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
    queue-length difference above which the least loaded replica wins; `match_rate_threshold`:
    the least matched fraction of the prompt's characters worth following) pass through."""

    def _extract_text_from_request(self, pending_request: Any) -> str:
        for arg in pending_request.args:
            if hasattr(arg, "prompt") or hasattr(arg, "messages"):
                return prompt_text(arg)
        raise ValueError("no moestream request among the call's arguments")
