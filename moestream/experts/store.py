"""PagedExpertStore: routed experts paged between a device slot pool, an optional host
cache and the checkpoint on disk (FluxMoE-style decoupled residency; MoE-Infinity-style
activation-aware caching and prefetch).

Each slot holds one expert's gate_up [2I, H] and down [H, I], or for a quantized checkpoint
its packed bytes (`PackedLayout`); the pool is allocated once.
`ensure(layer, ids)` makes the ids resident (a miss is a synchronous, timed load: a stall)
and returns views of their slots. Eviction follows a pluggable policy and never touches
an expert of the current `ensure` call, a pinned expert, or one being loaded.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moestream.config import ModelConfig
from moestream.experts.interface import ExpertKey, ExpertWeights, PackedExpert, PackedLayout
from moestream.experts.metrics import ExpertStats
from moestream.experts.policy import EvictionPolicy
from moestream.experts.prefetch import (
    HistoryPredictor,
    PrefetchQueue,
    start_prefetch_worker,
)
from moestream.experts.tiers import DiskTier, HostCache, TensorLocation, copy_expert
from moestream.experts.trace import RoutingRecorder  # noqa: TC001

logger = logging.getLogger(__name__)

PREFETCH_MODES = ("none", "gate", "history")
READ_CHUNK_BYTES = 1 << 20  # a disk miss is read in ranges of this many bytes, dealt to the read workers
PREFETCH_TARGETS = ("slots", "page_cache")


@dataclass
class _Started:
    """A `start`ed ensure call: its layer and ids, the weights it returns, its disk reads
    (slot, key) and their futures."""

    layer: int
    ids: tuple[int, ...]
    out: list[ExpertWeights | PackedExpert]
    reads: list[tuple[int, ExpertKey]]
    futures: list[Future]


class PagedExpertStore:
    """Device slots <- host cache <- disk, for all MoE layers of one model.

    Args:
        locations: (layer, expert) -> (gate, up, down) tensor locations in the checkpoint, or
            with `layout`, its stored tensors in the layout's order.
        num_layers: decoder layers (stats are indexed by decoder layer).
        moe_layers: decoder indices of MoE layers, ascending.
        num_experts, inter, hidden: expert count and shapes (I, H).
        dtype, device: compute dtype and device of the slots.
        num_slots: device slots (>= top_k + len(pinned)).
        slot_views: the slots' memory, one ExpertWeights view per slot id 0..num_slots-1 (an
            elastic memory pool's pages); None = the store allocates stacked [S, 2I, H] and
            [S, H, I] tensors. With an elastic pool, slots come and go (`release_slot`,
            `add_slot`) and a slot id is the pool's page id.
        host_cache_experts: experts the host cache may hold (0 = none).
        policy: eviction policy.
        pinned: experts loaded at start and never evicted.
        prefetch: "none", "gate" (router lookahead) or "history" (co-activation).
        prefetch_target: where a predicted expert goes. "slots": the worker reads it into a
            device slot (evicting by the policy), so the demand access is a hit. "page_cache":
            the worker only asks the kernel to read its bytes ahead (`DiskTier.advise`), so
            the demand miss copies from memory instead of waiting on the disk; it takes no
            slot and no CPU time on the compute path (the choice on CPU devices, where the
            slot copy competes with compute for the cores).
        top_k: router top-k (sizes history predictions).
        recorder: optional routing recorder.
        compute_in_place: a miss found in the host cache is computed from the host-cache
            buffers where they lie instead of being copied into a slot (Fiddler, ICLR'25:
            serve a miss where it costs least). The cost of a copy is expert_bytes over the
            copy bandwidth; computing in place costs nothing extra only when host and device
            memory are the same memory, so the engine turns this on for CPU devices, where the
            answer is always "in place" and the arithmetic is the same (same tensors' values,
            same dtype, same kernels). On CUDA the in-place choice would run the expert on the
            CPU, whose float arithmetic differs from the GPU's, so it stays off there.
        layout: a quantized checkpoint's `PackedLayout`: slots and the host cache hold each
            expert's packed bytes (`layout.nbytes`, the `expert_bytes`), which the executor
            dequantizes; None: dense experts in `dtype`.
        gated: False for ungated experts (Nemotron-H): gate_up is the up projection [I, H].
        read_workers: threads reading a call's disk misses at once (1: the caller reads them).
        direct_io: the read workers read with O_DIRECT, past the page cache
            (`DiskTier.direct_io`; `--expert-direct-io`).

    Raises:
        ValueError: fewer slots than top_k + pinned, or an unknown prefetch mode or target.
    """

    def __init__(
        self,
        locations: dict[ExpertKey, tuple[TensorLocation, ...]],
        num_layers: int,
        moe_layers: list[int],
        num_experts: int,
        inter: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        num_slots: int,
        host_cache_experts: int,
        policy: EvictionPolicy,
        pinned: Sequence[ExpertKey] = (),
        prefetch: str = "none",
        prefetch_target: str = "slots",
        top_k: int = 1,
        recorder: RoutingRecorder | None = None,
        compute_in_place: bool = False,
        slot_views: Sequence[ExpertWeights] | None = None,
        layout: PackedLayout | None = None,
        gated: bool = True,
        read_workers: int = 4,
        direct_io: bool = False,
    ) -> None:
        if prefetch not in PREFETCH_MODES:
            raise ValueError(f"unknown expert prefetch mode '{prefetch}'; use one of {', '.join(PREFETCH_MODES)}")
        if prefetch_target not in PREFETCH_TARGETS:
            raise ValueError(f"unknown expert prefetch target '{prefetch_target}'; use one of {', '.join(PREFETCH_TARGETS)}")
        pinned = list(dict.fromkeys(pinned))
        if num_slots < top_k + len(pinned):
            raise ValueError(f"{num_slots} expert slots cannot hold top_k={top_k} experts besides {len(pinned)} pinned ones")
        self.moe_layers = moe_layers
        self.num_slots = num_slots
        self.policy = policy
        self.pinned = frozenset(pinned)
        self.recorder = recorder
        self.metrics = ExpertStats(num_layers)
        if slot_views is not None and layout is not None:
            raise ValueError("elastic memory does not hold packed (quantized) experts yet")
        if slot_views is None and layout is not None:
            data = torch.empty(num_slots, layout.nbytes, dtype=torch.uint8, device=device)  # [S, nbytes]
            slot_views = [PackedExpert(data[i], layout) for i in range(num_slots)]
        elif slot_views is None:
            rows = (2 if gated else 1) * inter
            gate_up = torch.empty(num_slots, rows, hidden, dtype=dtype, device=device)  # [S, 2I, H] ([S, I, H] ungated)
            down = torch.empty(num_slots, hidden, inter, dtype=dtype, device=device)  # [S, H, I]
            slot_views = [ExpertWeights(gate_up[i], down[i]) for i in range(num_slots)]
        self._views: dict[int, ExpertWeights | PackedExpert] = dict(enumerate(slot_views[:num_slots]))  # slot -> memory
        self.min_slots = top_k + len(pinned)
        self.layout = layout
        self.expert_bytes = layout.nbytes if layout is not None else (
            (3 if gated else 2) * inter * hidden * torch.empty(0, dtype=dtype).element_size())
        self._disk = DiskTier(locations)
        self._prefetch_disk = DiskTier(locations, direct_io=direct_io and prefetch_target == "slots")
        # a call's disk misses are read concurrently (queue depth > 1), each worker with its own
        # files; with a host cache, misses go through it one at a time
        self._read_disks = [DiskTier(locations, random_access=True, direct_io=direct_io)
                            for _ in range(read_workers)] if (
            read_workers > 1 and host_cache_experts == 0) else []
        self.direct_io = any(d.direct_io for d in self._read_disks)
        self._read_pool = ThreadPoolExecutor(len(self._read_disks), thread_name_prefix="expert-read") if (
            self._read_disks) else None
        self._host = HostCache(host_cache_experts, inter, hidden, dtype, pin=device.type == "cuda", layout=layout,
                               gated=gated)
        self._slot_of: dict[ExpertKey, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._loading: set[ExpertKey] = set()
        self._in_use: frozenset[ExpertKey] = frozenset()
        self._started: _Started | None = None  # a start()ed ensure whose reads may be in flight
        self._unused_prefetched: dict[ExpertKey, int] = {}  # prefetched, not used yet -> bytes read
        self._queue = PrefetchQueue()
        self.prefetch_mode = prefetch
        self.prefetch_target = prefetch_target
        self.compute_in_place = compute_in_place
        self.lookahead = prefetch == "gate"
        self._history = HistoryPredictor(moe_layers, num_experts, width=2 * top_k) if prefetch == "history" else None
        for key in pinned:
            self._load_into(self._claim_slot(key[0]), key)
        self._thread = start_prefetch_worker(self.prefetch_one, self._queue) if prefetch != "none" else None

    # ---- the interface used by SparseMoE --------------------------------------------

    def max_experts_per_call(self) -> int:
        return self.num_slots - len(self.pinned)

    def on_route(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        ids = topk_ids.flatten()
        # abs: an approximate mode's folded weights may be negative (ExFold's projectors); routers' never are
        mass = torch.zeros(int(ids.max()) + 1, dtype=torch.float32).index_add_(
            0, ids.cpu(), topk_weights.flatten().float().abs().cpu())
        experts = torch.nonzero(mass).flatten().tolist()
        with self._queue.lock:
            self.policy.on_route(layer, experts, [mass[e].item() for e in experts])
        if self.recorder is not None:
            self.recorder.record_layer(layer, topk_ids)
        if self._history is not None:
            self._history.observe(layer, topk_ids)
            pred = self._history.predict(layer, topk_ids)
            if pred is not None:
                self.prefetch(*pred)

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        if self._thread is None:
            return
        with self._queue.lock:
            self._queue.put([(layer, e) for e in expert_ids if (layer, e) not in self._slot_of])

    def hint(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Retention hint: the next forward is expected to route `layer` to `expert_ids`
        (passed to the policy's `on_hint`; nothing is loaded)."""
        with self._queue.lock:
            self.policy.on_hint([(layer, int(e)) for e in expert_ids])

    def start(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Begin `ensure(layer, expert_ids)`: count the accesses, claim the misses' slots and
        start reading them on the read workers, then return while the reads are in flight, so
        that the caller computes meanwhile (SparseMoE: the shared experts). The matching
        `ensure` call waits for them; any other store call first finishes a started one. Same
        victims, counts and bytes as `ensure` alone.

        Raises:
            ValueError: more ids than `max_experts_per_call()`.
        """
        self._finish_started()
        if len(expert_ids) > self.max_experts_per_call():
            raise ValueError(f"ensure() got {len(expert_ids)} experts; at most {self.max_experts_per_call()} fit")
        keys = [(layer, e) for e in expert_ids]
        out = []
        with self._queue.lock:
            self._queue.drop_layer(layer)
            self._in_use = frozenset(keys)
            for key in keys:
                self.policy.on_access(key)
            in_place: set[ExpertKey] = set()  # host-cache entries this call reads where they lie
            reads: list[tuple[int, ExpertKey]] = []  # (slot, key) disk misses, read together below
            for key in keys:
                slot = self._slot_of.get(key)
                if slot is None and key in self._loading:
                    start = time.perf_counter()
                    while key in self._loading:
                        self._queue.cond.wait()
                    self.metrics.stall_seconds += time.perf_counter() - start
                    slot = self._slot_of.get(key)
                if slot is not None:
                    self.metrics.hits[layer] += 1
                    if self._unused_prefetched.pop(key, None) is not None:
                        self.metrics.prefetch_hits += 1
                    out.append(self._views[slot])
                    continue
                self.metrics.misses[layer] += 1
                cached = self._host.get(key) if self.compute_in_place else None
                if cached is not None:
                    self.metrics.host_computed += 1
                    in_place.add(key)
                    out.append(cached)
                    continue
                start = time.perf_counter()
                slot = self._claim_slot_waiting(layer)
                if self._read_pool is not None:  # reserved now (in use and loading: never a victim), read below
                    self._slot_of[key] = slot
                    self._loading.add(key)
                    self.policy.on_insert(key)
                    reads.append((slot, key))
                else:
                    self._load_into(slot, key, keep=in_place)
                self.metrics.stall_seconds += time.perf_counter() - start
                out.append(self._views[slot])
            futures = self._submit_reads(reads) if reads else []
        self._started = _Started(layer, tuple(expert_ids), out, reads, futures)

    def ensure(self, layer: int, expert_ids: Sequence[int]) -> list[ExpertWeights | PackedExpert]:
        """Make `expert_ids` of `layer` resident and return their weights, in order: slot views,
        or host-cache buffers for misses computed in place (`compute_in_place`), all valid
        until the next `ensure`. After `start(layer, expert_ids)`, waits for its reads.

        Raises:
            ValueError: more ids than `max_experts_per_call()`.
            OSError, ValueError: a disk read failed (its slots are given back first).
        """
        started = self._started
        if started is None or started.layer != layer or started.ids != tuple(expert_ids):
            self.start(layer, expert_ids)
            started = self._started
        self._started = None
        self._wait_reads(started)
        return started.out

    def _finish_started(self) -> None:
        """Wait for a `start`ed call that was never ensured (its slots then hold their experts)."""
        started, self._started = self._started, None
        if started is not None:
            self._wait_reads(started)

    def _submit_reads(self, reads: list[tuple[int, ExpertKey]]) -> list[Future]:
        """Start reading each (slot, key) of `reads` from disk into its slot, split over the read
        workers (caller holds the lock; the keys are in `_slot_of` and `_loading`); one future
        per worker job, each returning its bytes. The bytes of
        experts that read straight into their slots are cut into ranges at file offsets that are
        multiples of `READ_CHUNK_BYTES` (so that direct reads of neighbouring ranges share no
        block) and dealt to the workers in contiguous runs of equal size, so that one miss alone keeps
        every worker reading; others are read whole, one expert per job."""
        n = len(self._read_disks)
        ranges: list[tuple[str, int, memoryview]] = []
        whole: list[tuple[int, ExpertKey]] = []
        for slot, key in reads:
            pieces = self._disk.direct_ranges(key, self._views[slot])
            if pieces is None:
                whole.append((slot, key))
            else:
                for path, off, view in pieces:
                    cuts = [0, *range(-off % READ_CHUNK_BYTES or READ_CHUNK_BYTES, len(view), READ_CHUNK_BYTES), len(view)]
                    ranges += [(path, off + a, view[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]
        total = sum(len(v) for _, _, v in ranges)
        runs: list[list[tuple[str, int, memoryview]]] = [[] for _ in range(n)]
        done = 0
        for r in ranges:  # contiguous runs of about total / n bytes each
            runs[min(n - 1, done * n // max(total, 1))].append(r)
            done += len(r[2])

        def run(disk: DiskTier, ranges: list[tuple[str, int, memoryview]], part: list[tuple[int, ExpertKey]]) -> int:
            return (sum(disk.read_range(path, off, view) for path, off, view in ranges)
                    + sum(disk.read(key, self._views[slot]) for slot, key in part))

        return [self._read_pool.submit(run, self._read_disks[i], runs[i], whole[i::n])
                for i in range(n) if runs[i] or whole[i::n]]  # one job per worker and its DiskTier

    def _wait_reads(self, started: _Started) -> None:
        """Wait for a started call's reads (the wait is a stall). On a read error every key it
        read is dropped and its slot freed before the error is raised."""
        if not started.futures:
            return
        begin = time.perf_counter()
        errors, nbytes = [], 0
        for f in started.futures:
            try:
                nbytes += f.result()
            except Exception as e:  # noqa: BLE001 - re-raised after the slots are given back
                errors.append(e)
        with self._queue.lock:
            self.metrics.bytes_read_disk += nbytes
            self.metrics.stall_seconds += time.perf_counter() - begin
            for slot, key in started.reads:
                self._loading.discard(key)
                if errors:
                    del self._slot_of[key]
                    self.policy.on_evict(key)
                    self._free.append(slot)
            self._queue.cond.notify_all()
        if errors:
            raise errors[0]

    def available_experts(self, layer: int) -> list[int]:
        """Ids of `layer`'s experts that `ensure` would serve now without a disk read: in a
        slot (not being loaded), or, when misses are computed in place, in the host cache.
        Counts nothing and pins nothing (an approximate expert mode reads it)."""
        with self._queue.lock:
            ids = {e for (lay, e) in self._slot_of if lay == layer and (lay, e) not in self._loading}
            if self.compute_in_place:
                ids.update(e for (lay, e) in self._host.keys() if lay == layer)
            return sorted(ids)

    def resident_view(self, layer: int) -> dict[int, ExpertWeights | PackedExpert]:
        """The experts of `layer` on the device now (not being loaded), by id: their slot
        views, valid until the next `ensure` or `resident_view`. Nothing is loaded and no
        hit, miss or access is counted (a `draft_experts` draft pass reads them)."""
        self._finish_started()
        with self._queue.lock:
            keys = [k for k in self._slot_of if k[0] == layer and k not in self._loading]
            self._in_use = frozenset(keys)  # the prefetch worker leaves them in place meanwhile
            return {e: self._views[self._slot_of[(layer, e)]] for _, e in keys}

    # ---- slots -----------------------------------------------------------------------

    def release_slot(self) -> int | None:
        """Give up one slot (elastic memory: its bytes become KV blocks): a free slot if there
        is one, else the policy's victim among the evictable experts (not pinned, not loading)
        as the first MoE layer of the next step needs a slot. Call it between forwards only:
        the experts of the last `ensure` are taken to be no longer in use. Returns its slot
        id, or None when the store is at its minimum (top_k + pinned slots)."""
        self._finish_started()
        with self._queue.lock:
            if self.num_slots <= self.min_slots:
                return None
            self._in_use = frozenset()
            try:
                slot = self._free.pop() if self._free else self._claim_slot(self.moe_layers[0])
            except RuntimeError:
                return None
            del self._views[slot]
            self.num_slots -= 1
            return slot

    def add_slot(self, slot: int, views: ExpertWeights) -> None:
        """Take a slot (elastic memory: a page given back by the KV cache), free.

        Raises:
            ValueError: `slot` is already one of the store's slots.
        """
        with self._queue.lock:
            if slot in self._views:
                raise ValueError(f"slot {slot} already belongs to the expert store")
            self._views[slot] = views
            self._free.append(slot)
            self.num_slots += 1

    def _claim_slot(self, layer: int) -> int:
        """A free slot, or one freed by evicting the policy's victim (caller holds the lock).

        Raises:
            RuntimeError: every resident expert is in use, pinned or loading.
        """
        if self._free:
            return self._free.pop()
        protected = self._in_use | self.pinned | self._loading
        candidates = [k for k in self._slot_of if k not in protected]
        if not candidates:
            raise RuntimeError("no evictable expert slot: all are in use, pinned or loading")
        victim = self.policy.victim(candidates, layer)
        slot = self._slot_of.pop(victim)
        self.policy.on_evict(victim)
        self.metrics.evictions[victim[0]] += 1
        wasted = self._unused_prefetched.pop(victim, None)
        if wasted is not None:
            self.metrics.wasted_prefetch_bytes += wasted
        return slot

    def _claim_slot_waiting(self, layer: int) -> int:
        """`_claim_slot`, waiting for in-flight prefetches when they hold the only other slots."""
        while True:
            try:
                return self._claim_slot(layer)
            except RuntimeError:
                if not self._loading:
                    raise
                self._queue.cond.wait()

    def _load_into(self, slot: int, key: ExpertKey, disk: DiskTier | None = None,
                   keep: AbstractSet[ExpertKey] = frozenset()) -> None:
        """Fill `slot` with `key` from the host cache or disk, and make it resident (caller holds the lock).
        Host-cache entries in `keep` (being read in place) are not refilled.

        Copies are synchronous: a host-cache buffer may be refilled right after this returns.
        """
        dst = self._views[slot]
        cached = self._host.get(key)
        if cached is not None:
            copy_expert(dst, cached)
            self.metrics.bytes_read_host += self.expert_bytes
        else:
            buf = self._host.slot_for(key, keep)
            if buf is None:
                self.metrics.bytes_read_disk += (disk or self._disk).read(key, dst)
            else:
                self.metrics.bytes_read_disk += (disk or self._disk).read(key, buf)
                copy_expert(dst, buf)
        self._slot_of[key] = slot
        self.policy.on_insert(key)

    def prefetch_one(self, key: ExpertKey) -> None:
        """Load one predicted expert into a slot, or advise the kernel to read it ahead
        (`prefetch_target`); called by the prefetch worker."""
        if self.prefetch_target == "page_cache":  # the kernel reads; this thread only asks
            with self._queue.lock:
                if key in self._slot_of or key in self._host:
                    return
            try:
                nbytes = self._prefetch_disk.advise(key)
            except OSError:
                logger.warning("read-ahead advice for expert %d of layer %d failed", key[1], key[0], exc_info=True)
                with self._queue.lock:
                    self.metrics.prefetch_errors += 1
                return
            with self._queue.lock:
                self.metrics.prefetch_loads += 1
                self.metrics.prefetch_bytes += nbytes
            return
        with self._queue.lock:
            if key in self._slot_of or key in self._loading:
                return
            try:
                slot = self._claim_slot(key[0])
            except RuntimeError:
                return
            self._loading.add(key)
            # The slot is reserved: read outside the lock, into the slot directly (no other thread touches it).
        try:
            nbytes = self._prefetch_disk.read(key, self._views[slot])
        except Exception:
            # Give the slot back and wake any `ensure` waiting for this key: it loads the
            # expert itself, so a persistent read error surfaces there, on the engine thread.
            logger.warning("prefetch of expert %d of layer %d failed; it will be loaded on demand", key[1], key[0],
                           exc_info=True)
            with self._queue.lock:
                self._loading.discard(key)
                self._free.append(slot)
                self.metrics.prefetch_errors += 1
                self._queue.cond.notify_all()
            return
        with self._queue.lock:
            self._loading.discard(key)
            self._slot_of[key] = slot
            self.policy.on_insert(key)
            self._unused_prefetched[key] = nbytes
            self.metrics.prefetch_loads += 1
            self.metrics.prefetch_bytes += nbytes
            self.metrics.bytes_read_disk += nbytes
            self._queue.cond.notify_all()

    def stats(self) -> dict:
        """Metrics as a flat dict (see ExpertStats.as_dict), plus the pool's sizes (every slot
        is free or holds a resident expert (num_slots = free_slots + resident_experts between
        steps, with no prefetch in flight: loading_experts 0), the policy, the prefetch mode and
        whether the read workers read with O_DIRECT (`direct_io`)."""
        with self._queue.lock:
            d = self.metrics.as_dict()
            d.update(num_slots=self.num_slots, free_slots=len(self._free), loading_experts=len(self._loading),
                     expert_bytes=self.expert_bytes, resident_experts=len(self._slot_of),
                     host_cache_experts=len(self._host), policy=self.policy.name, prefetch=self.prefetch_mode,
                     direct_io=self.direct_io)
            return d

    def resident_experts(self) -> set[ExpertKey]:
        with self._queue.lock:
            return set(self._slot_of)

    def nbytes(self) -> int:
        """Bytes of the device slot pool."""
        return self.num_slots * self.expert_bytes

    def close(self) -> None:
        """Stop the prefetch worker and close files (after a started call's reads)."""
        try:
            self._finish_started()
        except Exception:  # noqa: BLE001 - closing: a read error has nowhere to go
            logger.warning("a started expert read failed while the store closed", exc_info=True)
        with self._queue.lock:
            self._queue.closed = True
            self._queue.cond.notify_all()
        self._disk.close()
        if self._read_pool is not None:
            self._read_pool.shutdown(wait=True)
            for disk in self._read_disks:
                disk.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def load_pin_profile(path: str, cfg: ModelConfig) -> list[ExpertKey]:
    """Experts to pin, from a JSON calibration profile {"<layer>": [expert ids], ...}.

    Raises:
        ValueError: unreadable file, a layer that is not an MoE layer, or an expert id out of range.
    """
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read expert pin profile '{path}' (want JSON {{\"layer\": [expert ids]}}): {e}") from e
    if not isinstance(raw, dict) or not all(
        isinstance(v, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in v) for v in raw.values()
    ):
        raise ValueError(f"expert pin profile '{path}' must be a JSON object mapping layer to a list of integer expert ids")
    try:
        pairs = list(dict.fromkeys((int(layer), e) for layer, experts in raw.items() for e in experts))
    except ValueError as e:
        raise ValueError(f"expert pin profile '{path}' has a layer key that is not an integer: {e}") from e
    for layer, e in pairs:
        if not (0 <= layer < cfg.num_layers and cfg.moe_layers[layer]):
            raise ValueError(f"pin profile '{path}' names layer {layer}, which is not an MoE layer of this model")
        if not 0 <= e < cfg.num_experts:
            raise ValueError(f"pin profile '{path}' names expert {e} of layer {layer}; the model has {cfg.num_experts}")
    return pairs
