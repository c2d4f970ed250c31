"""StateCheckpointPool: linear-attention state checkpoints for hybrid prefix caching.

A checkpoint is the whole linear-attention state of a sequence (conv and recurrent state of
every Gated DeltaNet layer) right after a block-aligned position p, keyed by the chained
hash of the KV block that ends at p (`kv_cache.hash_block`). A request whose prompt starts
with those p tokens copies the checkpoint into its own state slot and computes from p on;
a checkpoint is never changed in place.

Two tiers: device rows inside the StatePool's tensors (the model writes a capture straight
into one), and host copies (pinned on CUDA) up to a byte budget. When a device row is needed,
the least valuable device checkpoint moves to the host tier; when the host tier is full, the
least valuable checkpoint there is dropped.

Value follows Marconi (Pan et al., "Marconi: Prefix Caching for the Era of Hybrid LLMs",
arXiv 2411.19379): recency plus the compute a hit saves per byte held. Every checkpoint has
the same size, so compute per byte is proportional to the tokens it saves beyond the
checkpoint a hit would fall back to without it (its nearest ancestor in the same prefix
chain, when that is still cached; a decode checkpoint a block past a prompt's checkpoint
saves one block):

    value = recency + alpha * saved_tokens / max saved_tokens + bonus * (hit before),
    recency in [0, 1]

(normalised over the candidates). The bonus, beyond Marconi, keeps checkpoints that have
been hit at least once over ones never reused (a one-off prompt's interval checkpoints).
alpha = `eviction_alpha` (default 2), bonus = `hit_bonus` (default 1); both 0 is LRU.
bench/checkpoint_eviction.py measures the hit rate against both (results in
bench/results/checkpoint_eviction.md): under a budget of 8 checkpoints, LRU 11.1%,
recency + saved tokens (alpha 2) 37.0%, with the bonus 45.3%.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moestream.engine.state_pool import StatePool

EVICTION_ALPHA = 2.0
HIT_BONUS = 1.0


@dataclass
class Checkpoint:
    """One checkpoint: `num_tokens` tokens in; either device tensor `row` or `host` copies;
    `parent`: the key of the nearest checkpoint before it in its prefix chain, if any."""

    key: bytes
    num_tokens: int
    row: int | None = None
    host: list[torch.Tensor] | None = None
    last_used: int = 0
    parent: bytes | None = None
    hits: int = 0


@dataclass
class CheckpointStats:
    """Counters of the checkpoint pool.

    Attributes:
        captured: checkpoints stored.
        evictions: checkpoints dropped to make room (not those dropped with their KV block).
        demotions: checkpoints moved from the device tier to the host tier.
        restores: hits restored from a checkpoint.
    """

    captured: int = 0
    evictions: int = 0
    demotions: int = 0
    restores: int = 0


@dataclass
class StateCheckpointPool:
    """Checkpoints keyed by block hash over `num_rows` device rows of `state_pool` and a host
    tier of at most `host_bytes` bytes.

    Use: `take_row()` a device row before a forward that captures into it, then `register`
    it under its block hash (or `release_row` it if the forward failed); `get(key)` finds a
    checkpoint and `restore(key, request_id)` copies it into a resident request's slot.
    """

    state_pool: StatePool
    host_bytes: int
    eviction_alpha: float = EVICTION_ALPHA
    hit_bonus: float = HIT_BONUS
    stats: CheckpointStats = field(default_factory=CheckpointStats)

    def __post_init__(self) -> None:
        self.num_rows = self.state_pool.num_checkpoint_rows
        self._free_rows = [self.state_pool.checkpoint_row(i) for i in reversed(range(self.num_rows))]
        self._entries: dict[bytes, Checkpoint] = {}
        self._clock = 0

    # ---- sizes ----------------------------------------------------------------------

    @property
    def bytes_per_checkpoint(self) -> int:
        return self.state_pool.bytes_per_state

    @property
    def max_host_checkpoints(self) -> int:
        return self.host_bytes // self.bytes_per_checkpoint

    def num_device(self) -> int:
        return sum(1 for c in self._entries.values() if c.row is not None)

    def num_host(self) -> int:
        return sum(1 for c in self._entries.values() if c.host is not None)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Checkpoint | None:
        return self._entries.get(key)

    def as_dict(self) -> dict:
        """Counts and bytes per tier, and the counters of `CheckpointStats`."""
        dev, host = self.num_device(), self.num_host()
        size = self.bytes_per_checkpoint
        return {"checkpoints_device": dev, "checkpoints_host": host, "checkpoint_bytes_device": dev * size,
                "checkpoint_bytes_host": host * size, "checkpoints_captured": self.stats.captured,
                "checkpoint_evictions": self.stats.evictions, "checkpoint_demotions": self.stats.demotions}

    # ---- capture --------------------------------------------------------------------

    def take_row(self, protect: set[bytes] = frozenset()) -> int | None:
        """A free device row for a capture, demoting or dropping the least valuable device
        checkpoint (not one in `protect`) when none is free; None when the pool has no rows."""
        if self._free_rows:
            return self._free_rows.pop()
        victim = self._least_valuable([c for c in self._entries.values() if c.row is not None and c.key not in protect])
        if victim is None:
            return None
        row = victim.row
        if self.max_host_checkpoints > 0:
            if self.num_host() >= self.max_host_checkpoints:
                self._evict(self._least_valuable([c for c in self._entries.values() if c.host is not None]))
            victim.host = self.state_pool.read_row(row)
            victim.row = None
            self.stats.demotions += 1
        else:  # no host tier: drop it; its row goes to the caller, not back to the free list
            del self._entries[victim.key]
            self.stats.evictions += 1
        return row

    def release_row(self, row: int) -> None:
        """Give back a row from `take_row` that holds no checkpoint."""
        self._free_rows.append(row)

    def register(self, key: bytes, num_tokens: int, row: int, parent: bytes | None = None) -> bool:
        """Key the capture in device `row` as the checkpoint of block hash `key` (`parent`:
        the nearest checkpoint before it in its chain). Returns False when `key` has a
        checkpoint already: that one stays, and the row goes back."""
        if key in self._entries:
            self.release_row(row)
            return False
        self._clock += 1
        self._entries[key] = Checkpoint(key, num_tokens, row=row, last_used=self._clock, parent=parent)
        self.stats.captured += 1
        return True

    # ---- hit ------------------------------------------------------------------------

    def restore(self, key: bytes, request_id: str) -> None:
        """Copy checkpoint `key` into resident request `request_id`'s state slot.
        Raises KeyError if there is no such checkpoint."""
        ckpt = self._entries[key]
        self.state_pool.restore(request_id, row=ckpt.row, host=ckpt.host)
        self._clock += 1
        ckpt.last_used = self._clock
        ckpt.hits += 1
        self.stats.restores += 1

    def drop(self, key: bytes) -> None:
        """Forget checkpoint `key` (its KV block was evicted, or it was superseded); no-op if absent."""
        ckpt = self._entries.pop(key, None)
        if ckpt is not None and ckpt.row is not None:
            self._free_rows.append(ckpt.row)

    # ---- internals ------------------------------------------------------------------

    def _least_valuable(self, cands: list[Checkpoint]) -> Checkpoint | None:
        if not cands:
            return None
        lo, hi = min(c.last_used for c in cands), max(c.last_used for c in cands)
        saved = {c.key: self.saved_tokens(c) for c in cands}
        most = max(saved.values())

        def value(c: Checkpoint) -> tuple[float, bool, int]:  # ties: a never-hit one goes first, then the older
            recency = (c.last_used - lo) / (hi - lo) if hi > lo else 1.0
            bonus = self.hit_bonus * (c.hits > 0)
            return recency + self.eviction_alpha * saved[c.key] / most + bonus, c.hits > 0, c.last_used

        return min(cands, key=value)

    def saved_tokens(self, ckpt: Checkpoint) -> int:
        """Tokens a hit on `ckpt` saves beyond its parent checkpoint (all of them without one)."""
        parent = self._entries.get(ckpt.parent) if ckpt.parent is not None else None
        return ckpt.num_tokens - (parent.num_tokens if parent is not None else 0)

    def _evict(self, ckpt: Checkpoint | None) -> None:
        if ckpt is not None:
            self.drop(ckpt.key)
            self.stats.evictions += 1
