"""Elastic memory: one pool of pages shared at run time by routed-expert slots and KV blocks
(FluxMoE's residency decoupled from a fixed split).

The pool is one zero-initialised tensor of `num_pages` pages. A page holds either one expert
(gate_up [2I, H] then down [H, I]) or `blocks_per_page` KV blocks, each block being K and V
of `block_size` tokens in every KV layer. Block b lives in page b // blocks_per_page, so
the KV caches are strided views of the pool, [num_pages * blocks_per_page, block_size,
kv_heads, head_dim] per layer and K/V.

Pages [0, num_expert_pages) start as expert slots and the rest as KV blocks. When a
running request needs more KV blocks than are free (`grow_kv`), the expert store gives up
whole slots, free ones first, then its policy's least valuable expert; their pages become
free KV blocks. When no request waits and enough blocks are free (`shrink_kv`), borrowed
pages whose blocks are all free go back to the store. Every resize is logged. Outputs do
not depend on the split: only which memory holds which bytes changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moestream.engine.kv_cache import KVCacheManager  # noqa: TC001
from moestream.experts.interface import ExpertWeights
from moestream.experts.store import PagedExpertStore  # noqa: TC001

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PageGeometry:
    """Sizes in elements of the pool's dtype. `blocks_per_page` = ceil(expert elements / KV
    block elements); `page_elems` = blocks_per_page * KV block elements (>= expert elements)."""

    inter: int
    hidden: int
    num_kv_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None  # None: head_dim; 0: MLA's latent cache (keys only)

    @property
    def expert_elems(self) -> int:
        return 3 * self.inter * self.hidden

    @property
    def block_elems(self) -> int:
        return self.num_kv_layers * self.block_size * self.num_kv_heads * (self.head_dim + self.v_dim)

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def blocks_per_page(self) -> int:
        return max(1, -(-self.expert_elems // self.block_elems))

    @property
    def page_elems(self) -> int:
        return self.blocks_per_page * self.block_elems


class ElasticMemory:
    """The shared page pool and its split between the expert store and the KV cache.

    Args:
        geometry: page layout.
        num_expert_pages: pages that start as expert slots (the expert budget's slots).
        num_kv_pages: pages that start as KV blocks (the KV budget rounded up to pages).
        dtype, device: of the pool (the model's compute dtype).

    Call `bind(store, kv)` once both exist.

    Raises:
        ValueError: no KV page.
    """

    def __init__(self, geometry: PageGeometry, num_expert_pages: int, num_kv_pages: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if num_kv_pages < 1:
            raise ValueError("elastic memory needs at least one KV page")
        self.geometry = g = geometry
        self.num_pages = num_expert_pages + num_kv_pages
        self.pages = torch.zeros(self.num_pages, g.page_elems, dtype=dtype, device=device)  # [P, page]
        self.initial_expert_pages = num_expert_pages
        self._borrowed: set[int] = set()  # expert pages now holding KV blocks
        self.resizes = 0
        self.store: PagedExpertStore | None = None
        self.kv: KVCacheManager | None = None

    @property
    def num_blocks(self) -> int:
        """KV blocks the pool could hold in all (block ids 0 .. num_blocks - 1)."""
        return self.num_pages * self.geometry.blocks_per_page

    def expert_view(self, page: int) -> ExpertWeights:
        """Page `page` as one expert's gate_up [2I, H] and down [H, I]."""
        i, h = self.geometry.inter, self.geometry.hidden
        flat = self.pages[page]
        return ExpertWeights(flat[: 2 * i * h].view(2 * i, h), flat[2 * i * h : 3 * i * h].view(h, i))

    def expert_views(self) -> list[ExpertWeights]:
        """Views of the pages that start as expert slots, slot id = page id."""
        return [self.expert_view(p) for p in range(self.initial_expert_pages)]

    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per KV layer, K and V caches [num_blocks, block_size, kv_heads, head_dim or v_head_dim]
        (strided views)."""
        g = self.geometry
        k_elems = g.block_size * g.num_kv_heads * g.head_dim
        blocks = self.pages.view(self.num_blocks, g.num_kv_layers, -1)  # [N, L, K + V elements]
        shape = (g.block_size, g.num_kv_heads)
        return [(blocks[:, layer, :k_elems].unflatten(-1, shape + (g.head_dim,)),
                 blocks[:, layer, k_elems:].unflatten(-1, shape + (g.v_dim,))) for layer in range(g.num_kv_layers)]

    def blocks_of(self, page: int) -> list[int]:
        m = self.geometry.blocks_per_page
        return list(range(page * m, (page + 1) * m))

    def offline_blocks(self) -> list[int]:
        """Block ids inside the pages that start as expert slots."""
        return [b for p in range(self.initial_expert_pages) for b in self.blocks_of(p)]

    def bind(self, store: PagedExpertStore, kv: KVCacheManager) -> None:
        self.store, self.kv = store, kv

    def grow_kv(self, blocks_short: int) -> int:
        """Turn expert slots into KV blocks until `blocks_short` more blocks are free or the
        store is at its minimum. Returns the blocks added."""
        store, kv = self.store, self.kv
        assert store is not None and kv is not None, "bind() first"
        added = 0
        while added < blocks_short:
            page = store.release_slot()
            if page is None:
                break
            self.pages[page].zero_()  # blocks read as zeros until written, as a fresh KV cache
            kv.add_blocks(self.blocks_of(page))
            self._borrowed.add(page)
            added += self.geometry.blocks_per_page
            self.resizes += 1
            logger.info("elastic memory: expert slot %d became %d KV blocks (%d expert slots, %d KV blocks now)",
                        page, self.geometry.blocks_per_page, store.num_slots, kv.num_blocks)
        return added

    def shrink_kv(self, reserve_blocks: int) -> int:
        """Give borrowed pages whose blocks are all free back to the expert store while more
        than `reserve_blocks` free blocks remain after each. Returns the pages given back."""
        store, kv = self.store, self.kv
        assert store is not None and kv is not None, "bind() first"
        m = self.geometry.blocks_per_page
        given = 0
        for page in sorted(self._borrowed):
            if kv.num_free_blocks - m < reserve_blocks:
                break
            if kv.remove_free_blocks(self.blocks_of(page)):
                self._borrowed.discard(page)
                store.add_slot(page, self.expert_view(page))
                given += 1
                self.resizes += 1
                logger.info("elastic memory: %d KV blocks became expert slot %d (%d expert slots, %d KV blocks now)",
                            m, page, store.num_slots, kv.num_blocks)
        return given

    def stats(self) -> dict:
        """Pages per owner and resizes so far."""
        kv_pages = self.num_pages - self.initial_expert_pages + len(self._borrowed)
        return {"num_pages": self.num_pages, "page_bytes": self.pages[0].numel() * self.pages.element_size(),
                "expert_pages": self.num_pages - kv_pages, "kv_pages": kv_pages,
                "blocks_per_page": self.geometry.blocks_per_page, "resizes": self.resizes}
