"""Prefetch: a background worker that loads predicted experts into device slots ahead of
the router, and the predictors that feed it.

- Gate lookahead (Eliseev & Mazur 2023, "Fast Inference of Mixture-of-Experts Language
  Models with Offloading", the Mixtral-offloading trick): the model applies layer l+1's
  router to layer l's input and hints the top experts (done in `layers/moe.py`).
- History (`HistoryPredictor`): co-activation counts between consecutive MoE layers,
  learnt online from the router's choices; after layer l routes, the experts of layer l+1
  most often chosen together with layer l's experts are hinted.

The worker knows nothing of the store: it is given the queue and a bound method that loads
one key (`PagedExpertStore.prefetch_one`), and holds that method weakly, so dropping the
store stops it. Demand loads go first: `ensure` holds the queue's lock while it loads, and
a hint for a layer that `ensure` has reached is dropped.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable

import torch

from moestream.experts.interface import ExpertKey

logger = logging.getLogger(__name__)


class PrefetchQueue:
    """Keys waiting to be prefetched, with the lock and condition its owner shares (the
    paging store guards its own state with them, so the worker and demand loads take turns)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.keys: deque[ExpertKey] = deque()
        self.queued: set[ExpertKey] = set()
        self.closed = False

    def put(self, keys: list[ExpertKey]) -> None:
        """Queue keys (caller holds the lock)."""
        for k in keys:
            if k not in self.queued:
                self.queued.add(k)
                self.keys.append(k)
        self.cond.notify_all()

    def drop_layer(self, layer: int) -> None:
        """Forget queued keys of `layer` (caller holds the lock): demand has reached it."""
        if self.keys:
            kept = [k for k in self.keys if k[0] != layer]
            self.keys = deque(kept)
            self.queued = set(kept)


def start_prefetch_worker(load: Callable[[ExpertKey], None], queue: PrefetchQueue) -> threading.Thread:
    """Start a daemon thread that runs `load(key)` for queued keys. `load` is a bound method
    (the store's `prefetch_one`); the thread holds it weakly (`weakref.WeakMethod`) and ends
    once its object is gone or the queue is closed.

    Raises:
        TypeError: `load` is not a bound method.
    """
    ref = weakref.WeakMethod(load)
    thread = threading.Thread(target=_worker, args=(ref, queue), name="moestream-prefetch", daemon=True)
    thread.start()
    return thread


def _worker(ref: weakref.WeakMethod, queue: PrefetchQueue) -> None:
    while True:
        with queue.lock:
            while not queue.keys and not queue.closed:
                queue.cond.wait(timeout=1.0)
                if ref() is None:
                    return
            if queue.closed:
                return
            key = queue.keys.popleft()
            queue.queued.discard(key)
        load = ref()
        if load is None:
            return
        try:
            load(key)
        except Exception:  # never let the worker die silently: demand loads still work without it
            logger.exception("expert prefetch worker: loading %s failed", key)
        del load


class HistoryPredictor:
    """Co-activation counts between consecutive MoE layers.

    counts[l][a, b] = how often a token chose expert a at MoE layer l and expert b at the
    next MoE layer. `predict(l, topk_ids)` scores next-layer experts by summing the rows
    of the experts chosen now, and returns the `width` best with a non-zero score.
    """

    def __init__(self, moe_layers: list[int], num_experts: int, width: int) -> None:
        self.next_layer = {a: b for a, b in zip(moe_layers, moe_layers[1:])}
        self.counts = {layer: torch.zeros(num_experts, num_experts) for layer in moe_layers}
        self.width = width
        self._last: tuple[int, torch.Tensor] | None = None

    def observe(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Learn from this layer's choice (topk_ids [T, k]) paired with the previous layer's."""
        ids = topk_ids.detach().cpu()
        if self._last is not None and self.next_layer.get(self._last[0]) == layer and self._last[1].shape[0] == ids.shape[0]:
            prev = self._last[1]
            k_prev, k = prev.shape[1], ids.shape[1]
            rows = prev.repeat_interleave(k, dim=1).flatten()  # [T*kp*k]
            cols = ids.repeat(1, k_prev).flatten()
            self.counts[self._last[0]].index_put_((rows, cols), torch.ones(rows.shape[0]), accumulate=True)
        self._last = (layer, ids)

    def predict(self, layer: int, topk_ids: torch.Tensor) -> tuple[int, list[int]] | None:
        """(next MoE layer, predicted expert ids) or None at the last MoE layer."""
        nxt = self.next_layer.get(layer)
        if nxt is None:
            return None
        scores = self.counts[layer][topk_ids.detach().cpu().flatten()].sum(0)  # [E]
        top = torch.topk(scores, min(self.width, scores.shape[0]))
        return nxt, [e for e, s in zip(top.indices.tolist(), top.values.tolist()) if s > 0]
