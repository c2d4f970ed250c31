"""Paged KV cache: block pool, per-request block tables, and prefix caching.

Follows vLLM v1's block pool and KV cache manager (vllm/v1/core/block_pool.py,
kv_cache_manager.py):
- a full block is identified by a chained hash: sha256(parent block's hash + its token ids);
  equal hashes mean equal prefixes, so a new request reuses ("hits") the longest run of
  cached blocks that starts its tokens;
- blocks are reference-counted; a block whose count drops to 0 goes to the tail of the free
  queue but keeps its hash, so it can still be hit until it is reused for new tokens
  (evicted) from the head of the queue: least recently freed first, and since a request's
  blocks are freed last-block-first, leaf blocks before their parents;
- a block a request holds (count > 0) is never in the free queue, so never evicted.
Without prefix caching the same pool hands out and takes back blocks, with no hashes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

def slot_of(table: list[int], pos: int, block_size: int) -> int:
    """Slot mapping of token position `pos` in a sequence with block table `table`: the
    flat KV cache slot (block id * block_size + offset in the block) its KV is written to."""
    return table[pos // block_size] * block_size + pos % block_size


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   v_head_dim: int | None = None) -> int:
    """Bytes one block takes across all layers: K ([heads, head_dim] per token) and V
    ([heads, v_head_dim], default head_dim; 0 for MLA's latent cache), block_size tokens each."""
    per_token = num_kv_heads * (head_dim + (head_dim if v_head_dim is None else v_head_dim))
    return num_layers * block_size * per_token * torch.tensor([], dtype=dtype).element_size()


DEFAULT_KV_CAP_BYTES = 4 << 30


def num_kv_blocks(budget_bytes: int | None, block_bytes: int, block_size: int, max_model_len: int,
                  max_num_seqs: int) -> int:
    """Blocks in the KV pool: `budget_bytes` // `block_bytes`, or, with no budget, enough for
    `max_num_seqs` sequences of `max_model_len` tokens, capped at 4 GiB.

    Raises:
        ValueError: the pool cannot hold one sequence of max_model_len tokens.
    """
    blocks_per_seq = (max_model_len + block_size - 1) // block_size
    if budget_bytes is None:
        budget_bytes = min(DEFAULT_KV_CAP_BYTES, max_num_seqs * blocks_per_seq * block_bytes)
    num_blocks = budget_bytes // block_bytes
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"kv_cache_memory_bytes={budget_bytes} gives {num_blocks} blocks of {block_bytes} bytes, but one "
            f"sequence of max_model_len={max_model_len} needs {blocks_per_seq}; raise "
            f"kv_cache_memory_bytes to at least {blocks_per_seq * block_bytes} or lower max_model_len"
        )
    return num_blocks


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """The chained hash of one full block: sha256 of the parent block's hash (b"" for the
    first block), the block's token ids (as int64) and `extra` (the content hashes of the
    images whose placeholder tokens fall in the block, as vLLM's extra keys: the same
    placeholder ids with different images never share a block). 32 bytes."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes() + extra).digest()


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


class KVCacheManager:
    """Block pool, block tables and the prefix cache.

    `get_computed_blocks(request_id, token_ids)` finds the longest cached prefix;
    `allocate_slots(request_id, num_tokens, computed_blocks)` grows the request's block table
    to hold `num_tokens` tokens (taking the hit blocks first), all or nothing;
    `cache_blocks(request_id, token_ids, num_computed_tokens)` registers the request's
    blocks that are full and computed; `free(request_id)` gives all its blocks back.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: keep and hit full blocks' hashes.
        on_evict: called with a block's hash when the cached block is evicted (the hybrid
            models' state checkpoint keyed by it goes with it).
        offline_blocks: block ids that start outside the pool (elastic memory: their bytes
            hold expert slots); `add_blocks` / `remove_free_blocks` move blocks in and out.

    Raises:
        ValueError: fewer than one block in the pool.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 on_evict: Callable[[bytes], None] | None = None, offline_blocks: Sequence[int] = ()) -> None:
        offline = set(offline_blocks)
        if num_blocks - len(offline) < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks - len(offline)}")
        self.num_blocks = num_blocks - len(offline)  # blocks in the pool now (held or free)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self.on_evict = on_evict
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(b for b in range(num_blocks) if b not in offline)
        self._ref_count = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its full blocks so far
        self._num_cached: dict[str, int] = {}  # request id -> leading blocks of its table that are cached

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones among them can still be hit)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash in the prefix cache (held or free)."""
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def ref_count(self, block_id: int) -> int:
        """Requests holding `block_id`."""
        return self._ref_count[block_id]

    def block_hashes(self, request_id: str, token_ids: Sequence[int], num_blocks: int,
                     mm_spans: Sequence[tuple[int, int, bytes]] = ()) -> list[bytes]:
        """The chained hashes of the first `num_blocks` full blocks of `token_ids` (memoised
        per request; the tokens of a block never change once it is full). `mm_spans`: the
        request's images as (first token, end token, content hash); a block's hash includes
        those of the images overlapping it."""
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            lo, hi = i * bs, (i + 1) * bs
            extra = b"".join(h for start, end, h in mm_spans if start < hi and end > lo)
            hashes.append(hash_block(hashes[-1] if hashes else b"", token_ids[lo:hi], extra))
        return hashes[:num_blocks]

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],
                            mm_spans: Sequence[tuple[int, int, bytes]] = ()) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids`, in order; [] without prefix
        caching. At most `len(token_ids) - 1` tokens are hit (as vLLM), so the last token is
        always computed and gives the logits to sample from. Nothing is taken yet: pass the
        result to `allocate_slots`."""
        if not self.enable_prefix_caching or self._tables.get(request_id):
            return []
        hits = []
        for h in self.block_hashes(request_id, token_ids, (len(token_ids) - 1) // self.block_size, mm_spans):
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request of `num_tokens` tokens of which `num_hit_tokens` hit."""
        if self.enable_prefix_caching:
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    def blocks_short(self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()) -> int:
        """How many more free blocks `allocate_slots` with these arguments would need (0 = it fits)."""
        extra = self.blocks_needed(num_tokens) - len(self._tables.get(request_id, ())) - len(computed_blocks)
        free_hits = sum(1 for b in computed_blocks if self._ref_count[b] == 0)
        return max(0, extra - (len(self._free) - free_hits))

    def allocate_slots(self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Ensure `request_id` has blocks for `num_tokens` tokens, its table starting with
        `computed_blocks` (prefix hits, only for a request with no blocks yet). Returns
        False, taking nothing, when the free pool is too small."""
        table = self._tables.get(request_id)
        if table is None:
            table = []
        elif computed_blocks:
            raise ValueError(f"request '{request_id}' already has blocks; prefix hits apply only to a new request")
        extra = self.blocks_needed(num_tokens) - len(table) - len(computed_blocks)
        # Hit blocks that are free now leave the free queue when taken.
        free_hits = sum(1 for b in computed_blocks if self._ref_count[b] == 0)
        if extra > len(self._free) - free_hits:
            return False
        for block in computed_blocks:
            if self._ref_count[block] == 0:
                del self._free[block]
            self._ref_count[block] += 1
            table.append(block)
        if computed_blocks:
            self._num_cached[request_id] = len(computed_blocks)
        for _ in range(max(extra, 0)):
            block, _ = self._free.popitem(last=False)
            self._uncache(block)  # evict: reused for new tokens
            self._ref_count[block] = 1
            table.append(block)
        self._tables[request_id] = table
        return True

    def _uncache(self, block: int) -> None:
        """Drop a free block's hash from the prefix cache (it is about to be overwritten)."""
        h = self._block_hash[block]
        if h is not None:
            del self._cached[h]
            self._block_hash[block] = None
            self.stats.evictions += 1
            if self.on_evict is not None:
                self.on_evict(h)

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
            if block in self._free or self._ref_count[block] or self._block_hash[block] is not None:
                raise ValueError(f"block {block} is already in the KV cache pool")
        for block in block_ids:
            self._free[block] = None
            self._free.move_to_end(block, last=False)
        self.num_blocks += len(block_ids)

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                     mm_spans: Sequence[tuple[int, int, bytes]] = ()) -> None:
        """Register the blocks of `request_id` that are full and computed (the first
        `num_computed_tokens` of `token_ids`) in the prefix cache. A block whose hash is
        cached already (computed twice by requests running together) stays uncached."""
        if not self.enable_prefix_caching or request_id not in self._tables:
            return
        num_full = num_computed_tokens // self.block_size
        start = self._num_cached.get(request_id, 0)
        if num_full <= start:
            return
        table = self._tables[request_id]
        hashes = self.block_hashes(request_id, token_ids, num_full, mm_spans)
        for i in range(start, num_full):
            block, h = table[i], hashes[i]
            if self._block_hash[block] is None and h not in self._cached:
                self._cached[h] = block
                self._block_hash[block] = h
        self._num_cached[request_id] = num_full

    def free(self, request_id: str, num_useful_blocks: int | None = None) -> None:
        """Give back all of `request_id`'s blocks (no-op if it has none): each whose count
        drops to 0 goes to the tail of the free queue, last block first, keeping its hash.
        With `num_useful_blocks` (hybrid models: the blocks up to its last state
        checkpoint), the blocks after those go to the head instead: no hit can use them, so
        they are evicted first."""
        table = self._tables.pop(request_id, ())
        for i in reversed(range(len(table))):
            block = table[i]
            self._ref_count[block] -= 1
            if self._ref_count[block] == 0:
                self._free[block] = None
        if num_useful_blocks is not None:
            for block in table[num_useful_blocks:]:  # the last one ends at the head
                if self._ref_count[block] == 0:
                    self._free.move_to_end(block, last=False)
        self._hashes.pop(request_id, None)
        self._num_cached.pop(request_id, None)

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Give back `request_id`'s blocks past the first `num_tokens` tokens (speculative
        decoding: blocks taken for draft positions that were rejected). They hold no computed
        token, so they go to the head of the free queue. Returns the blocks given back."""
        table = self._tables.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if not table or len(table) <= keep:
            return 0
        extra = table[keep:]
        del table[keep:]
        for block in extra:
            self._ref_count[block] -= 1
            if self._ref_count[block] == 0:
                self._free[block] = None
                self._free.move_to_end(block, last=False)
        return len(extra)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def slot(self, request_id: str, position: int) -> int:
        """Cache slot (block_id * block_size + offset) of token `position` of `request_id`."""
        return self._tables[request_id][position // self.block_size] * self.block_size + position % self.block_size
