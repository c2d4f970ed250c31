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
    assert kv.allocate_slots("b", 12) and kv.block_table("b") == [2, 0, 1]


def test_zero_blocks_rejected() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        KVCacheManager(0, 16)


def test_block_bytes() -> None:
    # K and V x 3 layers x 16 tokens x 2 heads x 16 dims x 4 bytes
    assert kv_block_bytes(3, 16, 2, 16, torch.float32) == 2 * 3 * 16 * 2 * 16 * 4
    assert kv_block_bytes(3, 16, 2, 16, torch.bfloat16) == 2 * 3 * 16 * 2 * 16 * 2
