"""Paged KV cache: per-request block tables of one KV cache group, and prefix caching.

Follows vLLM v1's KV cache managers (vllm/v1/core/kv_cache_manager.py,
single_type_kv_cache_manager.py) over the shared `BlockPool` (block_pool.py):
- a full block is identified by a chained hash: sha256(parent block's hash + its token ids);
  equal hashes mean equal prefixes, so a new request reuses ("hits") the longest run of
  cached blocks that starts its tokens;
- a request's blocks are freed last block first, so leaf blocks are evicted before their
  parents;
- a sliding-window group (`window`, vLLM's SlidingWindowManager) gives back the blocks that
  fall wholly behind the window as the request advances: its table keeps NULL_BLOCK in
  their place, and the blocks keep their hash in the pool, so a later request can still
  hit them while they are not evicted.
Without prefix caching the same pool hands out and takes back blocks, with no hashes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moestream.engine.block_pool import BlockPool, PrefixCacheStats

# Block-table entry of a block a sliding-window group gave back (behind the window): never read.
NULL_BLOCK = -1

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


@dataclass(frozen=True)
class KVCacheGroup:
    """Attention layers that share block tables (vLLM's KV cache group).

    Attributes:
        window: their sliding window in tokens (blocks behind it are given back), or None.
        layers: their positions among the model's attention layers (`ModelConfig.attention_layers`).
    """

    window: int | None
    layers: tuple[int, ...]


def kv_cache_groups(windows: Sequence[int | None]) -> list[KVCacheGroup]:
    """The KV cache groups of attention layers with these windows (in layer order): one
    group when every layer has the same window (its blocks are kept whole, the window only
    masks, as before groups existed); else the full-attention layers, then those of each
    window. Layer k of every group reads and writes the same KV tensors, so a block holds
    the largest group's layer count (vLLM's hybrid allocator shares tensors the same way).

    Raises:
        ValueError: more than one distinct sliding window (the attention metadata carries
            one sliding group).
    """
    if len(set(windows)) <= 1:
        return [KVCacheGroup(None, tuple(range(len(windows))))]
    sliding = sorted({w for w in windows if w is not None})
    if len(sliding) > 1:
        raise ValueError(f"attention layers with {len(sliding)} different sliding windows {sliding} are not "
                         "supported (one sliding window next to full attention is)")
    groups = [KVCacheGroup(w, tuple(i for i, x in enumerate(windows) if x == w)) for w in (None, *sliding)]
    return [g for g in groups if g.layers]


def num_kv_blocks(budget_bytes: int | None, block_bytes: int, block_size: int, max_model_len: int,
                  max_num_seqs: int, num_groups: int = 1) -> int:
    """Blocks in the KV pool: `budget_bytes` // `block_bytes`, or, with no budget, enough for
    `max_num_seqs` sequences of `max_model_len` tokens in each of `num_groups` KV cache
    groups, capped at 4 GiB.

    Raises:
        ValueError: the pool cannot hold one sequence of max_model_len tokens.
    """
    blocks_per_seq = num_groups * ((max_model_len + block_size - 1) // block_size)
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


class KVCacheManager:
    """Block tables of one KV cache group and its prefix cache, over a `BlockPool`.

    `get_computed_blocks(request_id, token_ids)` finds the longest cached prefix;
    `allocate_slots(request_id, num_tokens, computed_blocks)` grows the request's block table
    to hold `num_tokens` tokens (taking the hit blocks first), all or nothing;
    `cache_blocks(request_id, token_ids, num_computed_tokens)` registers the request's
    blocks that are full and computed; `free(request_id)` gives all its blocks back.
    With a `window` (sliding-window attention), `remove_skipped_blocks` gives back the
    blocks no later query can attend to, and `window_hit` says whether the blocks a hit
    needs are cached.

    Args:
        num_blocks: blocks in the pool (ignored when `pool` is given).
        block_size: tokens per block.
        enable_prefix_caching: keep and hit full blocks' hashes.
        on_evict: called with a block's hash when the cached block is evicted (the hybrid
            models' state checkpoint keyed by it goes with it).
        offline_blocks: block ids that start outside the pool (elastic memory: their bytes
            hold expert slots); `add_blocks` / `remove_free_blocks` move blocks in and out.
        pool: another group's pool, to share (a model with several KV cache groups).
        window: the group's sliding window in tokens; None for full attention.
        group: the group's index; its blocks are cached under keys tagged with it.

    Raises:
        ValueError: fewer than one block in the pool, or a window below 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 on_evict: Callable[[bytes], None] | None = None, offline_blocks: Sequence[int] = (), *,
                 pool: BlockPool | None = None, window: int | None = None, group: int = 0) -> None:
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must be at least 1 token, got {window}")
        self.pool = pool if pool is not None else BlockPool(num_blocks, on_evict, offline_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.group = group
        self._tag = bytes([group]) if group else b""
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its full blocks so far
        self._num_cached: dict[str, int] = {}  # request id -> leading blocks of its table that are cached
        self._num_skipped: dict[str, int] = {}  # request id -> leading NULL_BLOCK entries of its table

    # ---- the pool's figures ---------------------------------------------------------------

    @property
    def stats(self) -> PrefixCacheStats:
        return self.pool.stats

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool now (held or free), shared by every group."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones among them can still be hit)."""
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash in the prefix cache (held or free, every group)."""
        return self.pool.num_cached_blocks

    @property
    def on_evict(self) -> Callable[[bytes], None] | None:
        return self.pool.on_evict

    @on_evict.setter
    def on_evict(self, fn: Callable[[bytes], None] | None) -> None:
        self.pool.on_evict = fn

    @property
    def num_used_blocks(self) -> int:
        """Distinct blocks this group's requests hold now."""
        return len({b for t in self._tables.values() for b in t if b != NULL_BLOCK})

    def ref_count(self, block_id: int) -> int:
        """Requests holding `block_id`."""
        return self.pool.ref_count(block_id)

    def remove_free_blocks(self, block_ids: Sequence[int]) -> bool:
        """See `BlockPool.remove_free_blocks`."""
        return self.pool.remove_free_blocks(block_ids)

    def add_blocks(self, block_ids: Sequence[int]) -> None:
        """See `BlockPool.add_blocks`."""
        self.pool.add_blocks(block_ids)

    # ---- hashes and hits ------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

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

    def cached_block(self, block_hash: bytes) -> int | None:
        """This group's cached block of `block_hash`, or None."""
        return self.pool.cached_block(self._tag + block_hash)

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],
                            mm_spans: Sequence[tuple[int, int, bytes]] = ()) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids`, in order; [] without prefix
        caching. At most `len(token_ids) - 1` tokens are hit (as vLLM), so the last token is
        always computed and gives the logits to sample from. Nothing is taken yet: pass the
        result to `allocate_slots`. (A sliding-window group's hits are the coordinator's:
        `window_hit`.)"""
        if not self.enable_prefix_caching or self._tables.get(request_id):
            return []
        hits = []
        for h in self.block_hashes(request_id, token_ids, (len(token_ids) - 1) // self.block_size, mm_spans):
            block = self.cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def first_needed_block(self, num_tokens: int) -> int:
        """Index of the first block a query at position `num_tokens` (or later) can attend to:
        0 for full attention; with a window W, the block of position num_tokens - W + 1
        (the positions before it are outside every later query's window)."""
        if self.window is None:
            return 0
        return max(0, num_tokens - self.window + 1) // self.block_size

    def window_hit(self, hashes: Sequence[bytes], num_blocks: int) -> list[int] | None:
        """The blocks a hit of `num_blocks` blocks (`hashes`: the request's block hashes, at
        least that many) takes in this group: NULL_BLOCK for those behind the window at the
        hit point, then this group's cached blocks up to it; None when one of those is not
        cached. For full attention every block must be cached."""
        first = self.first_needed_block(num_blocks * self.block_size)
        out = [NULL_BLOCK] * first
        for h in hashes[first:num_blocks]:
            block = self.cached_block(h)
            if block is None:
                return None
            out.append(block)
        return out

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request of `num_tokens` tokens of which `num_hit_tokens` hit."""
        if self.enable_prefix_caching:
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    # ---- allocation -----------------------------------------------------------------------

    def blocks_short(self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()) -> int:
        """How many more free blocks `allocate_slots` with these arguments would need (0 = it fits)."""
        extra = self.blocks_needed(num_tokens) - len(self._tables.get(request_id, ())) - len(computed_blocks)
        hits = [b for b in computed_blocks if b != NULL_BLOCK]
        return max(0, extra - (self.pool.num_free_blocks - self.pool.num_free_hits(hits)))

    def new_blocks_needed(self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()) -> int:
        """Free blocks `allocate_slots` with these arguments takes: new ones, and hit blocks
        that are free now."""
        extra = self.blocks_needed(num_tokens) - len(self._tables.get(request_id, ())) - len(computed_blocks)
        return max(extra, 0) + self.pool.num_free_hits([b for b in computed_blocks if b != NULL_BLOCK])

    def allocate_slots(self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Ensure `request_id` has blocks for `num_tokens` tokens, its table starting with
        `computed_blocks` (prefix hits, only for a request with no blocks yet; NULL_BLOCK
        entries stand for blocks behind a sliding window). Returns False, taking nothing,
        when the free pool is too small."""
        if self.new_blocks_needed(request_id, num_tokens, computed_blocks) > self.pool.num_free_blocks:
            return False
        self.take_hits(request_id, computed_blocks)
        table = self._tables.setdefault(request_id, [])
        table.extend(self.pool.take(max(self.blocks_needed(num_tokens) - len(table), 0)))
        return True

    def take_hits(self, request_id: str, computed_blocks: Sequence[int]) -> None:
        """Start a new request's table with its prefix hits (`allocate_slots`' first half:
        with several groups, every group takes its hits before any takes new blocks, so that
        no group hands out as new a free block another group hits).

        Raises:
            ValueError: the request has blocks already.
        """
        if not computed_blocks:
            return
        if self._tables.get(request_id):
            raise ValueError(f"request '{request_id}' already has blocks; prefix hits apply only to a new request")
        hits = [b for b in computed_blocks if b != NULL_BLOCK]
        self.pool.touch(hits)
        self._tables[request_id] = list(computed_blocks)
        self._num_cached[request_id] = len(computed_blocks)
        self._num_skipped[request_id] = len(computed_blocks) - len(hits)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Sliding window: give back the request's blocks behind the window of its next
        query (position `num_computed_tokens`), NULL_BLOCK in their place. They keep their
        hash in the pool, so they can still be hit until evicted. Returns the blocks given
        back (0 for full attention)."""
        table = self._tables.get(request_id)
        if self.window is None or not table:
            return 0
        first = min(self.first_needed_block(num_computed_tokens), len(table))
        done = self._num_skipped.get(request_id, 0)
        if first <= done:
            return 0
        skipped = [b for b in table[done:first] if b != NULL_BLOCK]
        table[done:first] = [NULL_BLOCK] * (first - done)
        self._num_skipped[request_id] = first
        self.pool.release(skipped[::-1])  # the newest of them is evicted last
        return len(skipped)

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
            if table[i] != NULL_BLOCK:
                self.pool.cache(table[i], self._tag + hashes[i])
        self._num_cached[request_id] = num_full

    def free(self, request_id: str, num_useful_blocks: int | None = None) -> None:
        """Give back all of `request_id`'s blocks (no-op if it has none): each whose count
        drops to 0 goes to the tail of the free queue, last block first, keeping its hash.
        With `num_useful_blocks` (hybrid models: the blocks up to its last state
        checkpoint), the blocks after those go to the head instead: no hit can use them, so
        they are evicted first."""
        table = [b for b in self._tables.pop(request_id, ())]
        self.pool.release([b for b in reversed(table) if b != NULL_BLOCK])
        if num_useful_blocks is not None:
            self.pool.move_to_head([b for b in table[num_useful_blocks:] if b != NULL_BLOCK])
        self._hashes.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        self._num_skipped.pop(request_id, None)

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Give back `request_id`'s blocks past the first `num_tokens` tokens (speculative
        decoding: blocks taken for draft positions that were rejected). They hold no computed
        token, so they go to the head of the free queue. Returns the blocks given back."""
        table = self._tables.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if not table or len(table) <= keep:
            return 0
        extra = [b for b in table[keep:] if b != NULL_BLOCK]
        del table[keep:]
        self.pool.release(extra, to_head=True)
        return len(extra)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def slot(self, request_id: str, position: int) -> int:
        """Cache slot (block_id * block_size + offset) of token `position` of `request_id`."""
        return self._tables[request_id][position // self.block_size] * self.block_size + position % self.block_size
