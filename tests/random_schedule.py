"""Drive an engine through a random schedule of arrivals and aborts (the hypothesis property
tests' shared loop)."""

from __future__ import annotations

from moestream import SamplingParams


def run_schedule(engine, prompts: list[list[int] | dict], params: SamplingParams, arrivals: list[tuple[int, int]],
                 aborts: list[tuple[int, int]]) -> tuple[dict[str, int], dict[str, list[int]], set[str]]:
    """Add request n (prompt arrivals[n][0]: token ids, or a prompt dict) at step arrivals[n][1], abort request aborts[m][0]
    (when it exists) at step aborts[m][1], and step until nothing is left. Returns (request id
    -> prompt index, finished request id -> output tokens, aborted request ids).

    Raises:
        AssertionError: after 500 steps without finishing (no progress).
    """
    pending = sorted(((step, i, f"r{n}") for n, (i, step) in enumerate(arrivals)), key=lambda x: x[0])
    abort_at: dict[int, list[str]] = {}
    for n, step in aborts:
        if n < len(arrivals):
            abort_at.setdefault(step, []).append(f"r{n}")
    prompt_of: dict[str, int] = {}
    finished: dict[str, list[int]] = {}
    aborted: set[str] = set()
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, i, rid = pending.pop(0)
            prompt = prompts[i] if isinstance(prompts[i], dict) else {"prompt_token_ids": prompts[i]}
            engine.add_request(prompt, params, request_id=rid)
            prompt_of[rid] = i
        for rid in abort_at.get(step, []):
            if engine.abort_request(rid) is not None:
                aborted.add(rid)
        for out in engine.step():
            if out.finished and out.request_id not in aborted:
                finished[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < 500, "the engine made no progress"
    return prompt_of, finished, aborted
