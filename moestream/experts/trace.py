"""Routing traces: record which experts each layer asked for, save/load them, and replay them
through an eviction policy to measure hit rates against Belady's optimum.

Trace file (our own `.npz`): `layer` [N] int16, `offsets` [N+1] int64, `experts` [M] int16;
access i is layer `layer[i]` asking for `experts[offsets[i]:offsets[i+1]]`. Optional `request`
[N] int32 and `token` [N] int32 say whose token (request index, position) it was.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from moestream.experts.policy import (
    POLICY_NAMES,
    BeladyPolicy,
    EvictionPolicy,
    ExpertKey,
    make_policy,
)

Access = tuple[int, tuple[int, ...]]  # (layer, expert ids)


class RoutingTrace:
    """An ordered list of accesses (layer, expert ids), with optional per-access request index
    and token position (both None, or both of length N)."""

    def __init__(self, layer: np.ndarray, offsets: np.ndarray, experts: np.ndarray,
                 request: np.ndarray | None = None, token: np.ndarray | None = None) -> None:
        self.layer = np.asarray(layer, dtype=np.int16)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.experts = np.asarray(experts, dtype=np.int16)
        n = len(self.layer)
        if len(self.offsets) != n + 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.experts):
            raise ValueError(f"offsets must have N+1 = {n + 1} entries from 0 to {len(self.experts)}")
        self.request = None if request is None else np.asarray(request, dtype=np.int32)
        self.token = None if token is None else np.asarray(token, dtype=np.int32)
        for name, meta in (("request", self.request), ("token", self.token)):
            if meta is not None and len(meta) != n:
                raise ValueError(f"{name} has {len(meta)} entries, expected {n}")

    @classmethod
    def from_accesses(cls, accesses: Iterable[Access], request: Sequence[int] | None = None,
                      token: Sequence[int] | None = None) -> RoutingTrace:
        """Build from (layer, expert ids) pairs."""
        layers, flat, offsets = [], [], [0]
        for layer, ids in accesses:
            layers.append(layer)
            flat.extend(ids)
            offsets.append(len(flat))
        return cls(np.array(layers, np.int16), np.array(offsets, np.int64), np.array(flat, np.int16),
                   None if request is None else np.array(request), None if token is None else np.array(token))

    def __len__(self) -> int:
        return len(self.layer)

    def __iter__(self) -> Iterator[Access]:
        layers, offs, flat = self.layer.tolist(), self.offsets.tolist(), self.experts.tolist()
        for i, layer in enumerate(layers):
            yield layer, tuple(flat[offs[i]:offs[i + 1]])

    def __getitem__(self, i: int) -> Access:
        return int(self.layer[i]), tuple(self.experts[self.offsets[i]:self.offsets[i + 1]].tolist())

    @property
    def num_key_accesses(self) -> int:
        return len(self.experts)

    def distinct_keys(self) -> int:
        """Number of distinct (layer, expert) keys in the trace."""
        layer_of = np.repeat(self.layer.astype(np.int64), np.diff(self.offsets))
        return len(np.unique(layer_of * 65536 + self.experts.astype(np.int64)))

    def save(self, path: str) -> None:
        """Write the `.npz` described in the module docstring."""
        arrays = {"layer": self.layer, "offsets": self.offsets, "experts": self.experts}
        if self.request is not None:
            arrays["request"] = self.request
        if self.token is not None:
            arrays["token"] = self.token
        with open(path, "wb") as f:  # a file object keeps numpy from appending ".npz"
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str) -> RoutingTrace:
        """Read a trace written by `save`. Raises KeyError when an array is missing."""
        with np.load(path) as z:
            return cls(z["layer"], z["offsets"], z["experts"],
                       z["request"] if "request" in z.files else None, z["token"] if "token" in z.files else None)

    @classmethod
    def from_deepseek_npz(cls, path: str, interleave: int = 1,
                          max_prompts: int | None = None) -> RoutingTrace:
        """Read the DeepSeek-V2-Lite prompt-routing trace (`../shared/traces/README.md`: one
        `prompt_<n>` array [T, 26, 6] int8 per prompt, taken in order of n).

        Each token gives 26 accesses (layer 0..25, its 6 experts in router order). With
        `interleave=k`, k prompts run concurrently: each round, every active prompt emits its
        next token (in slot order) and a finished prompt's slot goes to the next waiting one.
        `request` = prompt index in that order, `token` = position in the prompt.

        Raises:
            ValueError: interleave < 1, or an array name is not `prompt_<n>`.
        """
        if interleave < 1:
            raise ValueError(f"interleave must be >= 1, got {interleave}")
        with np.load(path) as z:
            if not all(name.startswith("prompt_") and name[7:].isdigit() for name in z.files):
                raise ValueError(f"{path}: expected arrays named prompt_<n> only")
            names = sorted(z.files, key=lambda name: int(name[7:]))[:max_prompts]
            prompts = [z[name] for name in names]
        order: list[tuple[int, int]] = []  # (prompt, token) in serving order
        waiting = [p for p, a in enumerate(prompts) if len(a)][::-1]
        slots: list[list[int] | None] = [None] * interleave  # [prompt, next token]
        while waiting or any(slots):
            for i, slot in enumerate(slots):
                if slot is None and waiting:
                    slots[i] = slot = [waiting.pop(), 0]
                if slot is not None:
                    order.append((slot[0], slot[1]))
                    slot[1] += 1
                    if slot[1] == len(prompts[slot[0]]):
                        slots[i] = None
        if not order:
            return cls(np.zeros(0, np.int16), np.zeros(1, np.int64), np.zeros(0, np.int16))
        p_idx, t_idx = np.array(order).T
        tokens = np.concatenate(prompts)[np.cumsum([0] + [len(a) for a in prompts])[p_idx] + t_idx]  # [n, L, k]
        n, num_layers, k = tokens.shape
        return cls(np.tile(np.arange(num_layers, dtype=np.int16), n), np.arange(n * num_layers + 1) * k,
                   tokens.reshape(-1), np.repeat(p_idx, num_layers), np.repeat(t_idx, num_layers))


class RoutingRecorder:
    """Collects the router's choices during serving: one record per (request, token, layer).

    Either `record(request_ids, token_positions, layer, topk_ids)` per MoE layer call, or
    `begin_step(request_ids, token_positions)` once per model forward (the ModelRunner calls it
    just before each forward: a hybrid model's step may run as several forwards, one per group
    of resident states) and then `record_layer(layer, topk_ids)` per MoE layer call of that
    forward (rows [T] in the forward's flat token order).
    """

    def __init__(self) -> None:
        self._tokens: dict[tuple[str, int], dict[int, tuple[int, ...]]] = {}  # first-seen order
        self._steps: list[Access] = []
        self._step_ids: tuple[list[str], list[int]] = ([], [])

    def begin_step(self, request_ids: Sequence[str], token_positions: Sequence[int]) -> None:
        """Name the rows of the coming forward's `record_layer` calls: row i of its flat batch
        [T] is token `token_positions[i]` [T] of request `request_ids[i]` [T]."""
        self._step_ids = (list(request_ids), list(token_positions))

    def record_layer(self, layer: int, topk_ids: torch.Tensor) -> None:
        """`record` with the ids given to the last `begin_step`; `topk_ids` [T, k]."""
        self.record(*self._step_ids, layer, topk_ids)

    def record(self, request_ids: Sequence[str], token_positions: Sequence[int], layer: int,
               topk_ids: torch.Tensor) -> None:
        """Record one MoE layer call: row i of `topk_ids` [T, k] is token `token_positions[i]` of
        request `request_ids[i]`. A recomputed token overwrites its earlier record.

        Raises:
            ValueError: lengths disagree.
        """
        rows = topk_ids.tolist()
        if not len(request_ids) == len(token_positions) == len(rows):
            raise ValueError(f"{len(request_ids)} request ids, {len(token_positions)} positions, {len(rows)} rows")
        for rid, pos, ids in zip(request_ids, token_positions, rows):
            self._tokens.setdefault((rid, int(pos)), {})[layer] = tuple(ids)
        self._steps.append((layer, tuple(sorted({e for ids in rows for e in ids}))))

    def to_trace(self, per_step: bool = False) -> RoutingTrace:
        """per_step=False: per token (first-seen order), its layers in ascending order, each with
        the router's top-k order, request index (first-seen order of ids) and position.
        per_step=True: one access per layer call, the sorted union of its tokens' experts (the
        order SparseMoE passes them to `ensure`), no metadata."""
        if per_step:
            return RoutingTrace.from_accesses(self._steps)
        req_index: dict[str, int] = {}
        accesses, request, token = [], [], []
        for (rid, pos), layers in self._tokens.items():
            for layer in sorted(layers):
                accesses.append((layer, layers[layer]))
                request.append(req_index.setdefault(rid, len(req_index)))
                token.append(pos)
        return RoutingTrace.from_accesses(accesses, request, token)

    def save(self, path: str, per_step: bool = False) -> None:
        """`to_trace(per_step).save(path)`."""
        self.to_trace(per_step).save(path)


@dataclass(frozen=True)
class SimResult:
    """Replay outcome, counted per (layer, expert) key access."""

    hits: int
    misses: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)


class _Evictable(AbstractSet):
    """Live view: resident keys minus pinned keys minus the current wave's keys."""

    def __init__(self, resident: dict[ExpertKey, None], pinned: AbstractSet, wave: set[ExpertKey]) -> None:
        self._resident, self._pinned, self._wave = resident, pinned, wave

    def __contains__(self, key: object) -> bool:
        return key in self._resident and key not in self._pinned and key not in self._wave

    def __iter__(self) -> Iterator[ExpertKey]:
        return (k for k in self._resident if k not in self._pinned and k not in self._wave)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def simulate(trace: RoutingTrace, policy: EvictionPolicy, capacity: int,
             pinned: AbstractSet[ExpertKey] = frozenset()) -> SimResult:
    """Replay `trace` through `policy` on a pool of `capacity` slots shared by all layers, as
    the paging store does. `pinned` keys are inserted first (sorted) and never evicted.

    Per access (layer, experts): `policy.on_route(layer, experts, [1.0] * k)`; then per expert,
    in order: `on_access`; hit if resident, else miss: when the pool is full, evict
    `policy.victim(candidates, layer)` with candidates = resident - pinned - the current wave's
    keys (`on_evict`), then insert (`on_insert`). An access fits in one wave (all its keys
    protected) when it has at most W = capacity - len(pinned) distinct experts; otherwise it
    runs in consecutive chunks of W experts, each chunk a wave protecting only its own keys.

    Raises:
        ValueError: capacity - len(pinned) < 1. RuntimeError: the policy chose a non-candidate.
    """
    pinned = frozenset(pinned)
    room = capacity - len(pinned)
    if room < 1:
        raise ValueError(f"capacity {capacity} leaves no slot beside {len(pinned)} pinned experts")
    resident: dict[ExpertKey, None] = {}
    wave: set[ExpertKey] = set()
    evictable = _Evictable(resident, pinned, wave)
    for key in sorted(pinned):
        resident[key] = None
        policy.on_insert(key)
    on_route, on_access, on_insert, on_evict = policy.on_route, policy.on_access, policy.on_insert, policy.on_evict
    hits = misses = evictions = 0
    for layer, experts in trace:
        on_route(layer, experts, [1.0] * len(experts))
        step = room if len(set(experts)) > room else max(1, len(experts))
        for start in range(0, len(experts), step):
            keys = [(layer, e) for e in experts[start:start + step]]
            wave.clear()
            wave.update(keys)
            for key in keys:
                on_access(key)
                if key in resident:
                    hits += 1
                    continue
                misses += 1
                if len(resident) >= capacity:
                    out = policy.victim(evictable, layer)
                    if out not in evictable:
                        raise RuntimeError(f"{policy.name} chose {out}, which is not an eviction candidate")
                    del resident[out]
                    on_evict(out)
                    evictions += 1
                resident[key] = None
                on_insert(key)
    return SimResult(hits, misses, evictions)


def future_of(trace: RoutingTrace) -> list[ExpertKey]:
    """The exact `on_access` key sequence `simulate` makes for `trace` (for BeladyPolicy).
    Equal keys share one tuple object to keep long futures small."""
    shared: dict[ExpertKey, ExpertKey] = {}
    return [shared.setdefault((layer, e), (layer, e)) for layer, experts in trace for e in experts]


def _hit_rate(job: tuple[RoutingTrace, str, int]) -> float:
    trace, name, capacity = job
    policy = BeladyPolicy(future_of(trace)) if name == "belady" else make_policy(name)
    return simulate(trace, policy, capacity).hit_rate


def trace_sim_main(argv: list[str] | None = None) -> int:
    """`moestream trace-sim TRACE ...`: replay a trace at several pool sizes and print each
    policy's hit rate next to Belady's (MIN). The replay is pure Python, about 2-15 us per key
    access depending on the policy (activation slowest), so DeepSeek traces default to their
    first 200 prompts (~3M key accesses) and (policy, size) runs go to `--jobs` processes.
    Returns the exit status."""
    p = argparse.ArgumentParser(prog="moestream trace-sim",
                                description="Replay a routing trace; print hit rates per policy and pool size.")
    p.add_argument("trace", help="a moestream trace .npz or the DeepSeek prompt-routing .npz")
    p.add_argument("--format", default="auto", choices=["auto", "moestream", "deepseek"])
    p.add_argument("--cache-sizes", default="0.05,0.1,0.25",
                   help="pool sizes in slots, comma-separated; a value below 1 is a fraction of the "
                        "trace's distinct (layer, expert) keys (default: 0.05,0.1,0.25)")
    p.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated (default: all)")
    p.add_argument("--interleave", type=int, default=1, help="DeepSeek: prompts served concurrently (default: 1)")
    p.add_argument("--max-prompts", type=int, default=200,
                   help="DeepSeek: first N prompts; 0 = all 1,000 (~15M key accesses, slow) (default: 200)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: all CPUs)")
    args = p.parse_args(argv)
    policies = [s for s in args.policies.split(",") if s]
    for name in policies:
        if name not in POLICY_NAMES:
            p.error(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}")
    if args.format == "auto":
        with np.load(args.trace) as z:
            args.format = "moestream" if "offsets" in z.files else "deepseek"
    trace = (RoutingTrace.load(args.trace) if args.format == "moestream" else
             RoutingTrace.from_deepseek_npz(args.trace, args.interleave, args.max_prompts or None))
    distinct = trace.distinct_keys()
    try:
        sizes = [int(v) if v >= 1 else max(1, round(v * distinct)) for v in map(float, args.cache_sizes.split(","))]
    except ValueError:
        p.error(f"--cache-sizes: expected numbers, got {args.cache_sizes!r}")
    print(f"trace: {len(trace)} accesses, {trace.num_key_accesses} key accesses, {distinct} distinct keys")
    cols = policies + ["belady"]
    jobs = [(trace, name, cap) for cap in sizes for name in cols]
    if args.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(args.jobs, len(jobs))) as pool:
            rates = list(pool.map(_hit_rate, jobs))
    else:
        rates = [_hit_rate(job) for job in jobs]
    print(f"{'slots':>8} " + " ".join(f"{c:>10}" for c in cols))
    for i, cap in enumerate(sizes):
        print(f"{cap:>8} " + " ".join(f"{r:>10.4f}" for r in rates[i * len(cols):(i + 1) * len(cols)]))
    return 0
