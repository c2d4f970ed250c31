"""Memory budget -> expert slots.

The user gives `expert_budget` as a fraction of all routed-expert bytes (a float in
(0, 1]) or as bytes (an int). Slots are equal-sized pages of one expert (FluxMoE's
decoupled residency), so the budget buys `budget // expert_bytes` slots. A budget that
covers every expert means full residency. The smallest legal budget is one layer's top-k
experts (plus pinned ones): a batch that needs more distinct experts in a layer runs in waves.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPlan:
    """Sizes in bytes; `num_slots` device slots (all experts when `resident`)."""

    resident: bool
    num_slots: int
    expert_bytes: int
    total_bytes: int
    budget_bytes: int
    host_cache_experts: int


def plan_experts(
    expert_budget: float | int | None,
    num_experts_total: int,
    expert_bytes: int,
    top_k: int,
    num_pinned: int = 0,
    host_cache_bytes: int = 0,
) -> ExpertPlan:
    """Turn a budget into slots.

    Args:
        expert_budget: None (all resident), a float fraction in (0, 1] of all routed-expert
            bytes, or an int number of bytes.
        num_experts_total: routed experts over all MoE layers.
        expert_bytes: bytes of one expert (gate + up + down) in the compute dtype, or its
            packed bytes for a quantized checkpoint (`PackedLayout.nbytes`).
        top_k: experts per token in one layer.
        num_pinned: experts pinned resident.
        host_cache_bytes: bytes of the host-memory cache.

    Raises:
        ValueError: a malformed budget, or one below the minimum (named in bytes).
    """
    total = num_experts_total * expert_bytes
    if expert_budget is None:
        return ExpertPlan(True, num_experts_total, expert_bytes, total, total, 0)
    if isinstance(expert_budget, bool) or not isinstance(expert_budget, numbers.Real):
        raise ValueError(f"expert_budget must be a fraction in (0, 1] or a number of bytes, got {expert_budget!r}")
    if not isinstance(expert_budget, numbers.Integral):
        if not 0.0 < expert_budget <= 1.0:
            raise ValueError(
                f"expert_budget={expert_budget} is not a fraction in (0, 1]; give a fraction of the routed-expert "
                "bytes, or an int number of bytes"
            )
        budget = int(expert_budget * total)
    else:
        if expert_budget <= 0:
            raise ValueError(f"expert_budget must be positive, got {expert_budget}")
        budget = int(expert_budget)
    if not isinstance(host_cache_bytes, int) or isinstance(host_cache_bytes, bool) or host_cache_bytes < 0:
        raise ValueError(f"expert host cache bytes must be a non-negative int, got {host_cache_bytes!r}")
    slots = budget // expert_bytes
    if slots >= num_experts_total:  # covers every expert: full residency, pins or not
        return ExpertPlan(True, num_experts_total, expert_bytes, total, budget, 0)
    minimum = top_k + num_pinned
    if slots < minimum:
        raise ValueError(
            f"expert_budget of {budget} bytes holds {slots} experts of {expert_bytes} bytes, but at least {minimum} "
            f"(top_k={top_k}{f' + {num_pinned} pinned' if num_pinned else ''}) must fit: the minimum budget is "
            f"{minimum * expert_bytes} bytes"
        )
    host = min(host_cache_bytes // expert_bytes, num_experts_total)
    return ExpertPlan(False, slots, expert_bytes, total, budget, host)
