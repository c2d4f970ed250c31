"""Block allocation and free, with exact block ids."""

import pytest
import torch

from moestream.engine.kv_cache import KVCacheManager, kv_block_bytes


def test_allocate_grow_and_free_exact_ids() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=16)
    assert kv.allocate_slots("a", 20)  # 2 blocks
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate_slots("b", 5)
    assert kv.block_table("b") == [2]
    assert kv.allocate_slots("a", 32)  # still 2 blocks: nothing new
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate_slots("a", 33)
    assert kv.block_table("a") == [0, 1, 3]
    assert kv.num_free_blocks == 2
    kv.free("b")
    assert kv.num_free_blocks == 3
    # Free queue is FIFO: 4, 5, then the freed 2.
    assert kv.allocate_slots("c", 48)
    assert kv.block_table("c") == [4, 5, 2]
    assert kv.slot("c", 0) == 64 and kv.slot("c", 17) == 81 and kv.slot("c", 47) == 47
    assert kv.slot("a", 32) == 3 * 16


def test_allocation_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate_slots("a", 8)
    assert not kv.allocate_slots("b", 9)  # needs 3, 1 free
    assert kv.block_table("b") == []
    assert kv.num_free_blocks == 1
    assert not kv.allocate_slots("a", 13)  # needs 2 more, 1 free
    assert kv.block_table("a") == [0, 1]
    kv.free("a")
    kv.free("a")  # a second free is a no-op, never a double free
    assert kv.num_free_blocks == 3
    # a's blocks went back last block first (leaves before parents): 2, then 1, 0.
    assert kv.allocate_slots("b", 12) and kv.block_table("b") == [2, 1, 0]


def test_zero_blocks_rejected() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        KVCacheManager(0, 16)


def test_block_bytes() -> None:
    # K and V x 3 layers x 16 tokens x 2 heads x 16 dims x 4 bytes
    assert kv_block_bytes(3, 16, 2, 16, torch.float32) == 2 * 3 * 16 * 2 * 16 * 4
    assert kv_block_bytes(3, 16, 2, 16, torch.bfloat16) == 2 * 3 * 16 * 2 * 16 * 2


# ---- prefix caching ----------------------------------------------------------------------------


def _run(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """Admit `rid` as the scheduler does, compute all its tokens, cache its full blocks;
    returns the hit blocks."""
    hits = kv.get_computed_blocks(rid, tokens)
    assert kv.allocate_slots(rid, len(tokens), hits)
    kv.record_query(len(tokens), len(hits) * kv.block_size)
    kv.cache_blocks(rid, tokens, len(tokens))
    return hits


def test_hits_are_the_longest_cached_prefix_and_never_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a = list(range(100, 110))  # 2 full blocks + 2 tokens
    assert _run(kv, "a", a) == [] and kv.block_table("a") == [0, 1, 2]
    assert kv.num_cached_blocks == 2  # the partial third block is not cached
    # Same first block, different second block: 1 block hit.
    assert _run(kv, "b", a[:4] + [7, 7, 7, 7, 7]) == [0]
    assert kv.block_table("b") == [0, 3, 4] and kv.ref_count(0) == 2
    # Exactly 1 block + 1 token: hits 1 block (vLLM #40696); exactly 2 blocks: hits only 1
    # (the last token is always computed); shorter than a block: 0.
    assert _run(kv, "c", a[:5]) == [0]
    assert _run(kv, "d", a[:8]) == [0]
    assert _run(kv, "e", a[:3]) == []
    assert kv.stats.queries == 10 + 9 + 5 + 8 + 3 and kv.stats.hits == 4 + 4 + 4
    assert kv.stats.hit_rate == 12 / 35


def test_freed_cached_blocks_are_hit_then_evicted_lru_leaves_first() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a = [1, 2, 3, 4, 5, 6, 9]  # blocks 0, 1, 2 full; 3 holds the last token
    _run(kv, "a", a)
    assert kv.block_table("a") == [0, 1, 2, 3]
    kv.free("a")
    assert kv.num_free_blocks == 6 and kv.num_cached_blocks == 3
    # Still hit after the free; taking the hit blocks back out of the free queue.
    assert _run(kv, "b", a) == [0, 1, 2] and kv.block_table("b") == [0, 1, 2, 4]
    kv.free("b")
    # Free queue, head first: 5 (never used), 3 (a's last block), then b's blocks last first:
    # 4, 2, 1, 0.
    assert _run(kv, "c", [8, 8, 8, 8, 8]) == []
    assert kv.block_table("c") == [5, 3, 4]
    assert kv.stats.evictions == 0 and kv.num_cached_blocks == 3 + 2  # c cached its 2 full blocks
    # The next one must evict: the leaf block 2 of prefix a goes before its parents 1 and 0.
    assert _run(kv, "d", [6, 6, 6]) == []
    assert kv.block_table("d") == [2, 1]
    assert kv.stats.evictions == 2
    # a's prefix now hits only its first block.
    assert kv.get_computed_blocks("e", a) == [0]


def test_a_held_block_is_never_evicted() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    _run(kv, "a", [1, 2, 3, 4, 5])  # holds 0, 1, 2
    assert _run(kv, "b", [1, 2, 3, 4, 7]) == [0, 1]  # shares 0, 1; takes 3
    assert kv.num_free_blocks == 0
    assert not kv.allocate_slots("c", 2)  # nothing free: no held block is taken
    kv.free("a")
    assert kv.ref_count(0) == 1 and kv.ref_count(1) == 1 and kv.num_free_blocks == 1  # only a's own block 2
    assert kv.allocate_slots("c", 2) and kv.block_table("c") == [2]
    kv.free("b")
    kv.free("c")
    assert all(kv.ref_count(i) == 0 for i in range(4)) and kv.num_free_blocks == 4


def test_prefix_caching_off_hits_nothing() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2)
    _run(kv, "a", [1, 2, 3, 4, 5])
    kv.free("a")
    assert kv.get_computed_blocks("b", [1, 2, 3, 4, 5]) == [] and kv.num_cached_blocks == 0
    assert kv.stats.queries == 0


# ---- KV cache groups: full + sliding window over one pool ---------------------------------------


def _groups(num_blocks: int, window: int = 6, block_size: int = 2):
    from moestream.engine.kv_cache_coordinator import KVCacheCoordinator

    full = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    sliding = KVCacheManager(0, block_size, enable_prefix_caching=True, pool=full.pool, window=window, group=1)
    return KVCacheCoordinator(full, groups=[sliding], state_checkpoint_interval=block_size), full, sliding


def _request(rid: str, tokens: list[int]):
    from moestream.engine.request import Request
    from moestream.sampling_params import SamplingParams

    return Request(rid, None, list(tokens), SamplingParams())


def _compute(coord, req, n: int) -> None:
    """What the scheduler and the engine do for n more tokens of `req`."""
    assert coord.allocate_slots(req, req.num_computed_tokens + n)
    req.num_computed_tokens += n
    coord.commit([(req, n)])


def test_sliding_group_gives_back_blocks_behind_the_window() -> None:
    from moestream.engine.kv_cache import NULL_BLOCK

    coord, full, sliding = _groups(40)
    r = _request("a", list(range(1, 21)))
    _compute(coord, r, 8)  # positions 0-7: nothing is behind the window of position 0 yet
    assert sliding.block_table("a") == [4, 5, 6, 7] and full.block_table("a") == [0, 1, 2, 3]
    _compute(coord, r, 3)  # scheduled at 8: positions >= 8 - 6 + 1 = 3 are needed, so blocks 0 (0-1) goes
    assert sliding.block_table("a")[:2] == [NULL_BLOCK, 5] and sliding.ref_count(4) == 0
    _compute(coord, r, 1)  # at 11: positions >= 6, blocks 0-2 go
    assert sliding.block_table("a")[:4] == [NULL_BLOCK] * 3 + [7]
    assert full.num_free_blocks == 40 - 6 - 3  # full holds 6 blocks (12 tokens), sliding 3 (blocks 3-5)
    coord.free(r)
    assert full.num_free_blocks == 40


def test_group_hits_are_taken_before_new_blocks() -> None:
    """Regression: with two groups, the full group took as new blocks the free blocks the
    sliding group was hitting (each group allocated in turn), so one block sat in both
    groups' tables and the two groups' layers overwrote each other's KV. Here the sliding
    blocks a hit needs were given back (behind the window) while `a` ran, so they sit ahead
    of a's other blocks in the free queue."""
    coord, full, sliding = _groups(24, window=4)
    shared = list(range(1, 9))  # 4 blocks
    a = _request("a", shared + list(range(100, 112)))
    for _ in range(5):
        _compute(coord, a, 4)
    coord.free(a)
    b = _request("b", shared + list(range(200, 216)))  # 12 blocks: 8 new ones in the full group
    hit = coord.find_prefix(b)
    assert hit.num_tokens == 8 and hit.group_blocks[0][:2] == [-1, -1]
    assert coord.allocate_slots(b, 24, hit)
    held_full = set(full.block_table("b"))
    held_sliding = {x for x in sliding.block_table("b") if x >= 0}
    assert len(held_full) == 12 and len(held_sliding) == 10 and not held_full & held_sliding
    assert all(full.ref_count(x) == 1 for x in held_full | held_sliding)


def test_window_hit_needs_only_the_last_window() -> None:
    """A hit of j blocks needs every full-group block, and in the sliding group the blocks of
    positions j*B - W + 1 .. j*B - 1 only: evicting an earlier sliding block keeps the hit."""
    coord, full, sliding = _groups(24, window=4)
    tokens = list(range(1, 13))  # 6 blocks of 2
    a = _request("a", tokens + [99])
    _compute(coord, a, 13)
    hashes = full.block_hashes("a", a.token_ids, 6)
    first_sliding = sliding.cached_block(hashes[0])
    coord.free(a)
    # evict the sliding group's first block (take it for something else)
    assert sliding.pool._key[first_sliding] is not None
    sliding.pool._free.move_to_end(first_sliding, last=False)
    taken = sliding.pool.take(1)
    assert taken == [first_sliding] and sliding.cached_block(hashes[0]) is None
    hit = coord.find_prefix(_request("b", tokens + [7, 7]))
    assert hit.num_tokens == 12  # blocks 4-5 (positions 9-11) are the window before token 12
    assert hit.group_blocks[0][:4] == [-1] * 4
