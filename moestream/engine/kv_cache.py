"""Paged KV cache: block accounting (block pool, per-request block tables) and the
cache tensors' size.

The pool hands out block ids from a free queue (FIFO) and takes them back at the tail, so
ids come out in a deterministic, testable order. The follow-up prefix-caching work keeps
freed blocks' hashes here and evicts from the head of this queue (vLLM v1 kv_cache_manager).
"""

from __future__ import annotations

from collections import deque

import torch


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers: K and V, block_size tokens each."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class KVCacheManager:
    """Block pool and block tables.

    `allocate_slots(request_id, num_tokens)` grows the request's block table to hold
    `num_tokens` tokens, all or nothing; `free(request_id)` returns all its blocks.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Ensure `request_id` has blocks for `num_tokens` tokens. Returns False, allocating
        nothing, when the free pool is too small."""
        table = self._tables.setdefault(request_id, [])
        extra = self.blocks_needed(num_tokens) - len(table)
        if extra > len(self._free):
            if not table:
                del self._tables[request_id]
            return False
        table.extend(self._free.popleft() for _ in range(extra))
        return True

    def free(self, request_id: str) -> None:
        """Return all of `request_id`'s blocks to the tail of the free queue (no-op if it has none)."""
        self._free.extend(self._tables.pop(request_id, ()))

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def slot(self, request_id: str, position: int) -> int:
        """Cache slot (block_id * block_size + offset) of token `position` of `request_id`."""
        return self._tables[request_id][position // self.block_size] * self.block_size + position % self.block_size
