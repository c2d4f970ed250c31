"""The KV block pool every KV cache group allocates from.

Follows vLLM v1's BlockPool (vllm/v1/core/block_pool.py):
- blocks are reference-counted; a block whose count drops to 0 goes to the tail of the free
  queue (or its head, when nothing can hit it) but keeps its cache key, so it can still be
  hit until it is taken for new tokens (evicted) from the head of the queue;
- a block a request holds (count > 0) is never in the free queue, so never evicted;
- a cached block is found by its key: the chained hash of its tokens, tagged with the KV
  cache group that wrote it (a full-attention block and a sliding-window block of the same
  tokens hold different layers' KV).
Elastic memory moves blocks in and out of the pool (`add_blocks`, `remove_free_blocks`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters (tokens, as vLLM's PrefixCacheStats).

    Attributes:
        queries: prompt tokens of the requests admitted (each admission counts once).
        hits: of those, tokens found in the cache (not computed).
        evictions: cached blocks reused for new tokens.
        recomputed: hybrid models: prompt tokens whose KV blocks were cached but that were
            computed again, from the last state checkpoint at or before the cached prefix's
            end (not counted in `hits`).
    """

    queries: int = 0
    hits: int = 0
    evictions: int = 0
    recomputed: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Free queue (eviction order: least recently freed first), reference counts, and the
    map from cache key to block.

    Args:
        num_blocks: block ids 0 .. num_blocks - 1.
        on_evict: called with a block's key when the cached block is evicted (the hybrid
            models' state checkpoint keyed by it goes with it).
        offline_blocks: block ids that start outside the pool (elastic memory).

    Raises:
        ValueError: fewer than one block in the pool.
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[bytes], None] | None = None,
                 offline_blocks: Sequence[int] = ()) -> None:
        offline = set(offline_blocks)
        if num_blocks - len(offline) < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks - len(offline)}")
        self.num_blocks = num_blocks - len(offline)  # blocks in the pool now (held or free)
        self.on_evict = on_evict
        self.stats = PrefixCacheStats()
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(b for b in range(num_blocks) if b not in offline)
        self._ref_count = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # cache key -> block id

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones among them can still be hit)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a key in the prefix cache (held or free)."""
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref_count[block]

    def is_free(self, block: int) -> bool:
        return block in self._free

    def cached_block(self, key: bytes) -> int | None:
        """The block cached under `key`, or None."""
        return self._cached.get(key)

    def num_free_hits(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` (prefix hits) are free now: taking them empties free slots."""
        return sum(1 for b in blocks if self._ref_count[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """One more holder for each of `blocks` (a prefix hit); free ones leave the free queue."""
        for block in blocks:
            if self._ref_count[block] == 0:
                del self._free[block]
            self._ref_count[block] += 1

    def take(self, n: int) -> list[int]:
        """`n` free blocks from the head of the queue, each evicted from the cache and held once.

        Raises:
            ValueError: fewer than `n` free blocks (callers check first).
        """
        if n > len(self._free):
            raise ValueError(f"{n} blocks asked of a pool with {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._uncache(block)
            self._ref_count[block] = 1
            out.append(block)
        return out

    def release(self, blocks: Sequence[int], to_head: bool = False) -> None:
        """One holder fewer for each of `blocks`, in order; each that drops to 0 joins the
        free queue at its tail (hit later, evicted last) or, `to_head`, at its head (the last
        given ends at the head: evicted first)."""
        for block in blocks:
            self._ref_count[block] -= 1
            if self._ref_count[block] == 0:
                self._free[block] = None
                if to_head:
                    self._free.move_to_end(block, last=False)

    def move_to_head(self, blocks: Sequence[int]) -> None:
        """Put those of `blocks` that are free at the head of the queue (no hit can use them);
        the last given ends first."""
        for block in blocks:
            if self._ref_count[block] == 0:
                self._free.move_to_end(block, last=False)

    def cache(self, block: int, key: bytes) -> None:
        """Register `block` under `key`, unless the block has a key already or the key is
        cached in another block (computed twice by requests running together)."""
        if self._key[block] is None and key not in self._cached:
            self._cached[key] = block
            self._key[block] = key

    def _uncache(self, block: int) -> None:
        """Drop a free block's key from the prefix cache (it is about to be overwritten)."""
        key = self._key[block]
        if key is not None:
            del self._cached[key]
            self._key[block] = None
            self.stats.evictions += 1
            if self.on_evict is not None:
                self.on_evict(key)

    def remove_free_blocks(self, block_ids: Sequence[int]) -> bool:
        """Take `block_ids` out of the pool (elastic memory: their bytes become an expert
        slot), all or nothing: False, taking nothing, unless every one is free. Cached ones
        are evicted from the prefix cache."""
        if not all(b in self._free for b in block_ids):
            return False
        for block in block_ids:
            self._uncache(block)
            del self._free[block]
        self.num_blocks -= len(block_ids)
        return True

    def add_blocks(self, block_ids: Sequence[int]) -> None:
        """Put blocks that were outside the pool into it, free and uncached (at the head of
        the free queue: they hold nothing worth keeping).

        Raises:
            ValueError: a block is already in the pool.
        """
        for block in block_ids:
            if block in self._free or self._ref_count[block] or self._key[block] is not None:
                raise ValueError(f"block {block} is already in the KV cache pool")
        for block in block_ids:
            self._free[block] = None
            self._free.move_to_end(block, last=False)
        self.num_blocks += len(block_ids)
