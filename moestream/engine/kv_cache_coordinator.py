"""KVCacheCoordinator: the one owner of a request's cache state, for every kind of layer.

Follows vLLM v1's KVCacheCoordinator (vllm/v1/core/kv_cache_coordinator.py), which puts
one manager per KV cache group behind one interface. Here it holds:
- the paged KV blocks of the attention layers and their prefix cache: one
  `KVCacheManager` per group over one block pool; a model that interleaves sliding-window
  and full attention (gpt-oss) has a full group (`kv`) and a sliding-window group, whose
  blocks behind the window go back to the pool as the request advances;
- hybrid models: the linear-attention state slots (`StatePool`) and the state checkpoints
  of the prefix cache (`StateCheckpointPool`).

Prefix hits over several groups (vLLM's HybridKVCacheCoordinator): the longest block-aligned
prefix for which every group has what it needs, the full group every block from the start,
a sliding group the blocks that hold the last `window - 1` tokens before the hit point
(`KVCacheManager.window_hit`). The block size stays the user's.

The scheduler calls `find_prefix` / `allocate_slots` / `admit` / `free` while it decides,
and `prepare_states` once it has chosen the step's requests (it makes their states resident
and plans the checkpoint captures); the engine calls `commit` after a successful step, or
`discard` after a failed one. The runner only reads block tables and the step's state
metadata.

Hybrid prefix caching. A KV block prefix alone cannot skip tokens on a hybrid model: the
linear-attention layers need their state at the prefix's end. So a hit is the longest
cached block prefix that ends at a state checkpoint; the cached blocks after that checkpoint
(up to the "branch point", where the request's tokens leave the cache) are computed again,
and a checkpoint is captured at the branch point, so that the next request sharing that
prefix hits all of it (Marconi's checkpointing of branch points, arXiv 2411.19379).
Checkpoints are captured at block-aligned positions while the model computes:
- the branch point of a request admitted past a cached prefix;
- every `state_checkpoint_interval` tokens of a prompt;
- the last full block of the prompt (and the block before it when the prompt is a whole
  number of blocks, since a resend of the same prompt can hit at most len - 1 tokens);
- the last full block of the tokens computed so far during decode (one per request,
  replaced as the output grows), so a follow-up turn that re-sends the whole exchange hits it.
The attention block size stays what the user set; a hit recomputes at most
`state_checkpoint_interval` tokens beyond the last checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moestream.engine.elastic_memory import ElasticMemory  # noqa: TC001
from moestream.engine.block_pool import PrefixCacheStats
from moestream.engine.cartridge_cache import CartridgeCache
from moestream.engine.kv_cache import KVCacheManager
from moestream.engine.request import Request
from moestream.engine.state_checkpoints import StateCheckpointPool
from moestream.engine.state_pool import StatePool


@dataclass(frozen=True)
class PrefixHit:
    """The cached prefix a waiting request can start after.

    Attributes:
        blocks: KV block ids to take, in order (`num_tokens / block_size` of them).
        num_tokens: tokens not computed (a multiple of the block size, or a request's
            cartridge positions P: `blocks` are then the cartridges' full blocks).
        checkpoint: hybrid models: the block hash of the state checkpoint to restore, or None.
        branch_point: tokens whose KV blocks are cached (>= num_tokens); on a hybrid model
            the ones past `num_tokens` are recomputed and a checkpoint is captured here.
        group_blocks: with several KV cache groups, the blocks each group after the first
            takes (NULL_BLOCK for those behind its window).
    """

    blocks: list[int]
    num_tokens: int
    checkpoint: bytes | None = None
    branch_point: int = 0
    group_blocks: tuple[list[int], ...] = ()


@dataclass(frozen=True)
class StatePlan:
    """The step's linear-attention state placement, from `prepare_states`.

    Attributes:
        slots: [B] the state slot of each scheduled request.
        captures: [B] per request, (offset, tensor row or None) pairs: after computing
            `offset` of its new tokens (1 <= offset <= its token count this step), the layer
            copies the state into checkpoint row `row` (`StateMetadata.captures`).
    """

    slots: list[int]
    captures: list[list[tuple[int, int | None]]]


class KVCacheCoordinator:
    """Allocation, prefix hits and freeing across KV blocks, state slots and checkpoints.

    Args:
        kv: the block manager of the first KV cache group (the full-attention layers).
        groups: the block managers of the other groups, sharing kv's pool (gpt-oss: its
            sliding-window layers).
        state_pool: hybrid models: the linear-attention state slots; None otherwise.
        checkpoints: hybrid models with prefix caching: the state checkpoint pool.
        state_checkpoint_interval: tokens between checkpoints in a prompt (a multiple of
            the block size when there is a state pool; unused otherwise).
        elastic: the page pool shared with the expert store (`ElasticMemory`), or None.
        cartridges: the engine's `CartridgeCache` (requests that start after cartridges), or None.

    Raises:
        ValueError: an interval that is not positive, or (with a state pool) not a multiple
            of the block size.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        state_pool: StatePool | None = None,
        checkpoints: StateCheckpointPool | None = None,
        state_checkpoint_interval: int = 512,
        elastic: ElasticMemory | None = None,
        groups: Sequence[KVCacheManager] = (),
        cartridges: CartridgeCache | None = None,
    ) -> None:
        if state_checkpoint_interval < 1 or (state_pool is not None and state_checkpoint_interval % kv.block_size):
            raise ValueError(f"state_checkpoint_interval must be a positive multiple of block_size {kv.block_size}, "
                             f"got {state_checkpoint_interval}")
        if any(g.pool is not kv.pool for g in groups):
            raise ValueError("every KV cache group must allocate from the same block pool")
        self.kv = kv
        self.groups: list[KVCacheManager] = [kv, *groups]
        self.state_pool = state_pool
        self.checkpoints = checkpoints
        self.interval = state_checkpoint_interval
        self.elastic = elastic
        self.cartridges = cartridges
        if checkpoints is not None:
            kv.on_evict = checkpoints.drop  # a checkpoint goes with the block it ends on
        self._restore: dict[str, bytes] = {}  # request id -> checkpoint to restore at its first forward
        self._restore_host: dict[str, tuple] = {}  # request id -> a cartridge's state to restore (host tensors)
        self._branch: dict[str, int] = {}  # request id -> branch point to capture
        self._output_ckpt: dict[str, bytes] = {}  # request id -> its latest decode checkpoint
        self._pending: list[tuple[Request, bytes, int, int, bool]] = []  # (request, key, tokens, row, decode)
        self._verify: dict[str, tuple[int, int]] = {}  # request id -> (computed tokens, positions) of its verify

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def stats(self) -> PrefixCacheStats:
        return self.kv.stats

    @property
    def max_states(self) -> int | None:
        """Requests one step can run (state slots) on a hybrid model; None otherwise."""
        return None if self.state_pool is None else self.state_pool.max_resident

    # ---- admission ------------------------------------------------------------------

    def find_prefix(self, req: Request) -> PrefixHit | None:
        """The longest usable cached prefix of a waiting request's tokens (nothing taken);
        none for a request that asks for prompt logprobs (every position must be computed).
        A request with cartridges starts at least after them: their composition is pinned
        now (`CartridgeCache.pin`), and None means the pool cannot hold it yet (the request
        waits; `cancel_prefix` if it is not admitted after all)."""
        if req.cartridge is None:
            return self._cached_prefix(req)
        pinned = self.cartridges.pin(req.request_id, req.cartridge)
        if pinned is None:
            return None
        num = req.num_prefix_tokens
        hit = self._cached_prefix(req)
        if hit.num_tokens > num:  # cached blocks (and a checkpoint) past the cartridges
            return hit
        return PrefixHit(list(pinned), num, None, max(num, hit.branch_point))

    def cancel_prefix(self, req: Request) -> None:
        """A request `find_prefix` pinned cartridges for was not admitted: unpin them."""
        if self.cartridges is not None:
            self.cartridges.unpin(req.request_id)

    def _cached_prefix(self, req: Request) -> PrefixHit:
        """`find_prefix` from the prefix cache alone."""
        if req.sampling_params.prompt_logprobs is not None:
            return PrefixHit([], 0, None, 0, tuple([] for _ in self.groups[1:]))
        if len(self.groups) > 1 or self.kv.window is not None:
            return self._find_group_prefix(req)
        blocks = self.kv.get_computed_blocks(req.request_id, req.token_ids, req.mm_hash_spans)
        bs = self.block_size
        if self.state_pool is None:
            return PrefixHit(blocks, len(blocks) * bs, None, len(blocks) * bs)
        if self.checkpoints is None or not blocks:
            return PrefixHit([], 0, None, 0)
        hashes = self.kv.block_hashes(req.request_id, req.token_ids, len(blocks), req.mm_hash_spans)
        j = len(blocks)
        while j > 0 and hashes[j - 1] not in self.checkpoints:
            j -= 1
        return PrefixHit(blocks[:j], j * bs, hashes[j - 1] if j else None, len(blocks) * bs)

    def _find_group_prefix(self, req: Request) -> PrefixHit:
        """`find_prefix` over several KV cache groups (or one sliding-window group): the
        longest j blocks that every group can supply (`KVCacheManager.window_hit`), j at
        most the full groups' cached run and (len - 1) // block_size, as vLLM hits at most
        len - 1 tokens."""
        kv, bs = self.kv, self.block_size
        if not kv.enable_prefix_caching or kv.block_table(req.request_id):
            return PrefixHit([], 0, None, 0, tuple([] for _ in self.groups[1:]))
        hashes = kv.block_hashes(req.request_id, req.token_ids, (req.num_tokens - 1) // bs, req.mm_hash_spans)
        j = len(hashes)
        for g in self.groups:
            if g.window is None:  # a full group's hit is a run of cached blocks from the start
                j = next((i for i, h in enumerate(hashes[:j]) if g.cached_block(h) is None), j)
        while j > 0:
            hits = [g.window_hit(hashes, j) for g in self.groups]
            if all(h is not None for h in hits):
                return PrefixHit(hits[0], j * bs, None, j * bs, tuple(hits[1:]))
            j -= 1
        return PrefixHit([], 0, None, 0, tuple([] for _ in self.groups[1:]))

    def allocate_slots(self, req: Request, num_tokens: int, hit: PrefixHit | None = None,
                       may_grow: bool = False) -> bool:
        """Blocks for `num_tokens` of `req`'s tokens in every KV cache group (a new request's
        tables start with `hit`'s blocks); a sliding-window group first gives back the
        request's blocks behind the window of its next token. Returns False, taking
        nothing, when the pool is too small. With `may_grow` (a running request) and
        elastic memory, expert slots are turned into KV blocks first."""
        rid = req.request_id
        computed = [hit.blocks if hit is not None else (), *(hit.group_blocks if hit is not None and hit.group_blocks
                                                             else [()] * (len(self.groups) - 1))]
        if len(self.groups) == 1 and self.kv.window is None:
            if self.kv.allocate_slots(rid, num_tokens, computed[0]):
                return True
            if not may_grow or self.elastic is None:
                return False
            self.elastic.grow_kv(self.kv.blocks_short(rid, num_tokens, computed[0]))
            return self.kv.allocate_slots(rid, num_tokens, computed[0])
        for g in self.groups:
            g.remove_skipped_blocks(rid, req.num_computed_tokens)
        needed = sum(g.new_blocks_needed(rid, num_tokens, c) for g, c in zip(self.groups, computed))
        if needed > self.kv.num_free_blocks:
            return False
        for g, c in zip(self.groups, computed):  # every group's hits leave the free queue first
            g.take_hits(rid, c)
        for g in self.groups:
            ok = g.allocate_slots(rid, num_tokens)
            assert ok, "a KV cache group's allocation failed after the pool was checked"
        return True

    def release_kv(self, reserve_blocks: int) -> None:
        """KV demand fell (no request waits): elastic memory gives borrowed pages whose blocks
        are all free back to the expert store, keeping `reserve_blocks` free blocks."""
        if self.elastic is not None:
            self.elastic.shrink_kv(reserve_blocks)

    def admit(self, req: Request, hit: PrefixHit) -> None:
        """Record an admitted request's hit: it starts at `hit.num_tokens`, its state comes
        from `hit.checkpoint` at its first forward. A request starting right after its
        cartridges gets their last P mod block_size entries copied into its next block, and
        on a hybrid model the last cartridge's state."""
        num = req.num_prefix_tokens
        self.kv.record_query(req.num_tokens - num, hit.num_tokens - num)
        req.num_computed_tokens = hit.num_tokens
        if req.cartridge is not None and hit.num_tokens == num:
            if num % self.block_size:
                self.cartridges.write_tail(req.cartridge, self.kv.block_table(req.request_id)[num // self.block_size])
            if self.state_pool is not None:
                self._restore_host[req.request_id] = req.cartridge.parts[-1].states
        if self.state_pool is not None:
            self.stats.recomputed += hit.branch_point - hit.num_tokens
            if hit.checkpoint is not None:
                self._restore[req.request_id] = hit.checkpoint
            if hit.branch_point > hit.num_tokens:
                self._branch[req.request_id] = hit.branch_point

    def free(self, req: Request) -> None:
        """Give back `req`'s blocks and state slot (finished, aborted or preempted), and its
        pin on its cartridges. On a hybrid model, its blocks after its last checkpoint are
        evicted first."""
        rid = req.request_id
        useful = None
        if self.checkpoints is not None:
            table = self.kv.block_table(rid)
            n = min(len(table), req.num_computed_tokens // self.block_size)
            hashes = self.kv.block_hashes(rid, req.token_ids, n, req.mm_hash_spans) if n else []
            useful = next((i + 1 for i in reversed(range(n)) if hashes[i] in self.checkpoints), 0)
        self.kv.free(rid, useful)
        for g in self.groups[1:]:
            g.free(rid)
        if self.state_pool is not None:
            self.state_pool.free(rid)
        self._restore.pop(rid, None)
        self._restore_host.pop(rid, None)
        self._branch.pop(rid, None)
        self._output_ckpt.pop(rid, None)
        if self.cartridges is not None:
            self.cartridges.unpin(rid)

    # ---- the step -------------------------------------------------------------------

    def prepare_states(self, scheduled: list[tuple[Request, int]]) -> StatePlan | None:
        """Make the scheduled requests' states resident (swapping others out; a request
        starting at token 0 gets a zeroed state, one with a hit its checkpoint) and plan
        the checkpoint captures of this step. None on a model without linear layers.

        Raises:
            ValueError: more requests than state slots.
        """
        self._verify = {r.request_id: (r.num_computed_tokens, n) for r, n in scheduled if r.spec_token_ids}
        if self.state_pool is None:
            return None
        ids = [r.request_id for r, _ in scheduled]
        fresh = [r.num_computed_tokens == 0 or r.request_id in self._restore or r.request_id in self._restore_host
                 for r, _ in scheduled]
        slots = self.state_pool.prepare(ids, fresh)
        for rid in ids:
            key = self._restore.pop(rid, None)
            if key is not None:
                self.checkpoints.restore(key, rid)
            host = self._restore_host.pop(rid, None)
            if host is not None:
                self.state_pool.restore(rid, host=list(host))
        captures = [self._plan_captures(r, n, n - len(r.spec_token_ids)) for r, n in scheduled]
        for (req, n), slot, caps in zip(scheduled, slots, captures):
            if req.spec_token_ids:  # the state after each position but the last: its rollback points
                caps += [(j + 1, self.state_pool.spec_row(slot, j)) for j in range(len(req.spec_token_ids))]
        return StatePlan(slots, captures)

    def _plan_captures(self, req: Request, n: int, num_verified: int) -> list[tuple[int, int | None]]:
        """Captures for `req`'s `n` new tokens, the first `num_verified` of them verified (the
        rest drafts). A capture at a draft position gets a row, but its block hash is only
        known, and it only enters the cache, once the draft is accepted (`commit`)."""
        if self.checkpoints is None or self.checkpoints.num_rows == 0:
            return []
        bs, start, end = self.block_size, req.num_computed_tokens, req.num_computed_tokens + n
        plen = req.num_prompt_tokens
        wanted = {p for p in range(start + (-start % self.interval), min(end, plen) + 1, self.interval) if p > start}
        wanted |= {p for p in (plen // bs * bs, (plen - 1) // bs * bs, self._branch.get(req.request_id, 0))
                   if start < p <= end}
        decode_at = end // bs * bs
        decode = decode_at > plen and decode_at > start and decode_at not in wanted
        if decode:
            wanted.add(decode_at)
        out: list[tuple[int, int | None]] = []
        for p in sorted(wanted):
            if p == 0:
                continue
            row = None
            if p > start + num_verified:  # after a draft token: keyed at commit, if accepted
                row = self.checkpoints.take_row()
                if row is not None:
                    self._pending.append((req, None, p, row, decode and p == decode_at))
                out.append((p - start, row))
                continue
            key = self.kv.block_hashes(req.request_id, req.token_ids, p // bs, req.mm_hash_spans)[-1]
            if key not in self.checkpoints and all(k != key for _, k, _, _, _ in self._pending):
                if decode and p == decode_at:  # the request's previous decode checkpoint gives way
                    old = self._output_ckpt.pop(req.request_id, None)
                    if old is not None:
                        self.checkpoints.drop(old)
                row = self.checkpoints.take_row()
                if row is not None:
                    self._pending.append((req, key, p, row, decode and p == decode_at))
            out.append((p - start, row))  # split here even without a row: the pieces a hit runs
        return out

    def commit(self, scheduled: list[tuple[Request, int]]) -> None:
        """After a successful step (`num_computed_tokens` advanced past the accepted tokens):
        give each verified request's slot the state after its last accepted position,
        return blocks taken for rejected drafts, and register the computed full blocks in the
        prefix cache and the captured checkpoints under their block hashes. Only verified
        tokens' blocks and states are ever cached (drafts never: vLLM #43559)."""
        for req, _ in scheduled:
            rid = req.request_id
            verify = self._verify.pop(rid, None)
            if verify is not None:
                if self.state_pool is not None and req.num_computed_tokens > verify[0]:
                    # The slot takes the state after the last accepted position.
                    self.state_pool.accept(rid, req.num_computed_tokens - verify[0], verify[1])
                for g in self.groups:  # blocks taken for rejected drafts go back
                    g.trim(rid, req.num_computed_tokens + 1)
            for g in self.groups:
                g.cache_blocks(rid, req.token_ids, req.num_computed_tokens, req.mm_hash_spans)
            self._branch.pop(rid, None)
        bs = self.block_size
        for req, key, num_tokens, row, decode in self._pending:
            rid = req.request_id
            if num_tokens > req.num_computed_tokens:  # after a rejected draft: never cached
                self.checkpoints.release_row(row)
                continue
            if key is None:  # after accepted drafts: their tokens are the request's now
                key = self.kv.block_hashes(rid, req.token_ids, num_tokens // bs, req.mm_hash_spans)[-1]
                old = self._output_ckpt.get(rid) if decode else None
                if old is not None and old != key:
                    del self._output_ckpt[rid]
                    self.checkpoints.drop(old)
            chain = self.kv.block_hashes(rid, req.token_ids, num_tokens // bs - 1, req.mm_hash_spans)
            parent = next((h for h in reversed(chain) if h in self.checkpoints), None)
            if self.checkpoints.register(key, num_tokens, row, parent) and decode:
                self._output_ckpt[rid] = key
        self._pending.clear()

    def discard(self) -> None:
        """After a failed step: give back the rows planned for captures."""
        for _, _, _, row, _ in self._pending:
            self.checkpoints.release_row(row)
        self._pending.clear()
        self._verify.clear()

    # ---- reading --------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        """The request's block table in the first KV cache group."""
        return self.kv.block_table(request_id)

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's block table in each KV cache group, in group order."""
        return [g.block_table(request_id) for g in self.groups]

    def kv_group_stats(self) -> list[dict]:
        """Per KV cache group: its kind ("full" or "sliding"), window (tokens or None) and
        the distinct blocks its requests hold now."""
        return [{"kind": "full" if g.window is None else "sliding", "window": g.window,
                 "used_blocks": g.num_used_blocks} for g in self.groups]

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache figures: enabled, queries, hits, hit_rate (tokens), evictions
        (blocks), cached_blocks, recomputed_tokens; on hybrid models also the checkpoint
        counts and bytes per tier (`StateCheckpointPool.as_dict`)."""
        kv = self.kv
        out = {"enabled": kv.enable_prefix_caching, "queries": kv.stats.queries, "hits": kv.stats.hits,
               "hit_rate": kv.stats.hit_rate, "evictions": kv.stats.evictions, "cached_blocks": kv.num_cached_blocks,
               "recomputed_tokens": kv.stats.recomputed}
        if self.checkpoints is not None:
            out.update(self.checkpoints.as_dict())
        return out
