"""CartridgeCache: cartridges resolved, checked, and held in KV blocks that requests share.

A request with cartridges C1..Cn starts after P = p1 + ... + pn positions whose KV is the
cartridges', in order: its token list begins with P placeholder ids (`PLACEHOLDER_TOKEN`,
never computed), its tokens follow at positions P, P+1, ... (rotary positions continue from
P, as in the Cartridges paper), and its first P // block_size blocks are the composition's
shared blocks. The rest of the composition (P mod block_size positions) is copied into the
request's own next block at admission, since the request writes its tokens after it.

Sharing and eviction. The full blocks of a composition are written once into the KV block
pool and registered in the prefix cache under chained block hashes whose extra key is each
cartridge's file digest at its first position (so the hash chain of a request's blocks
starts from its cartridges, and prefix caching works on top: a second request with the same
cartridges and prompt hits the blocks after them too). While requests run with it, the
composition is pinned: the cache holds one reference on its blocks besides theirs. When the
last one finishes, is preempted or aborted, the pin goes and the blocks join the free queue
like any cached block: evicted least recently used first, only when unused, and found again
by the next request while they last (else written again from the host copy). The
composition's blocks are cached so even with prefix caching off (requests' own blocks are
not).

Hybrid models: a cartridge carries the linear layers' states after its last position; a
request starts from the last cartridge's state. Their states compose only along a chain
(each cartridge built after the one before it, `--after`), which the composition checks.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moestream.cartridges.format import Cartridge, CartridgeError, load_cartridge
from moestream.engine.block_pool import BlockPool
from moestream.engine.kv_cache import hash_block

logger = logging.getLogger(__name__)

PLACEHOLDER_TOKEN = -1  # the token id of a cartridge position in a request's token list (never embedded)
MAX_LOADED_CARTRIDGES = 32  # host copies kept (least recently used dropped first)


@dataclass(frozen=True)
class CartridgeSpec:
    """What a cartridge must match to serve on an engine.

    Attributes:
        model_hash: the checkpoint's `model_fingerprint`.
        num_layers: attention (cache) layers.
        kv_dims: (heads, key dim, value dim) of one cache entry (`ModelConfig.kv_cache_dims`).
        state_shapes: hybrid models: (shape, dtype) of each state tensor of one request,
            in `StatePool.read_row`'s order (shapes must match; dtypes are cast at restore);
            () otherwise.
    """

    model_hash: str
    num_layers: int
    kv_dims: tuple[int, int, int]
    state_shapes: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()


def check_cartridge(cart: Cartridge, spec: CartridgeSpec) -> None:
    """Refuse a cartridge that does not fit the engine's model.

    Raises:
        CartridgeError: another model's (fingerprint), another number of layers, another
            KV entry shape, or state tensors that do not match, naming what differs.
    """
    name = f"cartridge '{cart.id}' ({cart.path})"
    if cart.model_hash != spec.model_hash:
        raise CartridgeError(f"{name} was built for another model (fingerprint {cart.model_hash[:12]}, this model's "
                             f"is {spec.model_hash[:12]}); build it for this checkpoint with `moestream cartridge build`")
    if len(cart.keys) != spec.num_layers:
        raise CartridgeError(f"{name} has {len(cart.keys)} attention layers, this model has {spec.num_layers}")
    heads, k_dim, v_dim = spec.kv_dims
    for i, (k, v) in enumerate(zip(cart.keys, cart.values)):
        if tuple(k.shape[1:]) != (heads, k_dim) or tuple(v.shape[1:]) != (heads, v_dim):
            raise CartridgeError(f"{name}: layer {i} holds keys {tuple(k.shape[1:])} and values {tuple(v.shape[1:])} "
                                 f"per position, this model caches ({heads}, {k_dim}) and ({heads}, {v_dim})")
    got = [tuple(t.shape) for t in cart.states]
    want = [shape for shape, _ in spec.state_shapes]
    if got != want:
        what = "linear-attention states" if spec.state_shapes else "no linear-attention states"
        raise CartridgeError(f"{name} holds {len(got)} state tensors of shapes {got[:2]}... that do not match this "
                             f"model's {what} ({len(want)} tensors of shapes {want[:2]}...)")


@dataclass(frozen=True)
class CartridgePrefix:
    """The cartridges a request starts after, composed in order.

    Attributes:
        parts: the cartridges, in order.
        num_tokens: P, their positions together.
        hash_spans: (position, position + 1, digest) of each part: extra keys of the block hashes.
    """

    parts: tuple[Cartridge, ...]
    num_tokens: int
    hash_spans: tuple[tuple[int, int, bytes], ...]

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(c.digest for c in self.parts)

    @property
    def ids(self) -> list[str]:
        return [c.id for c in self.parts]


@dataclass(frozen=True)
class CartridgeRoute:
    """What became of the cartridges a request named (reported in its output).

    Attributes:
        ids: the cartridges' ids, in order.
        routing: "always" or "auto" (the router decided).
        attached: whether the request starts after them.
        relevance: auto: the best part's relevance (nats per token) and `threshold` its
            threshold; None with "always" or for cartridges without a router.
        num_tokens: P, their positions (counted whether attached or not).
    """

    ids: tuple[str, ...]
    routing: str
    attached: bool
    relevance: float | None = None
    threshold: float | None = None
    num_tokens: int = 0

    def as_dict(self) -> dict:
        return {"ids": list(self.ids), "routing": self.routing, "attached": self.attached,
                "relevance": self.relevance, "threshold": self.threshold, "positions": self.num_tokens}


ROUTING_MODES = ("always", "auto")


@dataclass
class _Pin:
    blocks: list[int]
    users: set[str]


class CartridgeCache:
    """Loads cartridges once (host copies, least recently used dropped past 32), composes
    them for requests, and holds compositions in shared KV blocks (`pin` / `unpin`).

    Args:
        spec: what a cartridge must match.
        pool: the KV block pool (first KV cache group).
        block_size: tokens per block.
        cartridge_dir: where cartridge ids resolve (`<dir>/<id>.safetensors`); None: ids
            must be paths.
        dtype: the KV cache dtype (cartridges of another dtype are cast, with a warning).
        default_routing: `cartridge_routing` of requests that do not set it.
        unsupported: why this engine serves no cartridges (every composition is refused
            naming it), or None.
    """

    def __init__(self, spec: CartridgeSpec, pool: BlockPool, block_size: int, cartridge_dir: str | None,
                 dtype: torch.dtype, default_routing: str = "always", unsupported: str | None = None) -> None:
        self.spec = spec
        self.pool = pool
        self.block_size = block_size
        self.cartridge_dir = cartridge_dir
        self.dtype = dtype
        self.default_routing = default_routing
        self.unsupported = unsupported
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # the runner's, set by the builder
        self._lock = threading.Lock()  # `compose` may run on the server's tokenizer thread
        self._loaded: OrderedDict[tuple[str, float, int], Cartridge] = OrderedDict()
        self._flat: OrderedDict[tuple[str, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = OrderedDict()
        self._pins: dict[tuple[str, ...], _Pin] = {}
        self._user_key: dict[str, tuple[str, ...]] = {}
        self.num_block_writes = 0  # blocks written from a host copy
        self.num_block_reuses = 0  # blocks a pin found still cached

    # ---- resolving and composing ------------------------------------------------------------

    def resolve_path(self, item: str | dict) -> str:
        """The file of one cartridge reference: a dict with `id` and optional `source`
        ("local", Tokasaurus's field) and `path` (moestream's), or a str (an id, or a path
        when it ends in .safetensors). An id names `<cartridge_dir>/<id>.safetensors`.

        Raises:
            CartridgeError: an unknown field or source, no id or path, an id with a path
                separator, or an id without a cartridge directory.
        """
        if isinstance(item, str):
            item = {"path": item} if item.endswith(".safetensors") else {"id": item}
        if not isinstance(item, dict):
            raise CartridgeError(f"a cartridge is an id, a path or {{'id', 'source', 'path'}}, got {type(item).__name__}")
        unknown = set(item) - {"id", "source", "path", "force_redownload"}
        if unknown:
            raise CartridgeError(f"unknown cartridge field(s) {sorted(unknown)}; use id, source and path")
        source = item.get("source", "local")
        if source != "local":
            raise CartridgeError(f"cartridge source {source!r} is not supported: moestream reads local cartridges "
                                 "(source 'local'); copy it into --cartridge-dir")
        if item.get("path") is not None:
            if not isinstance(item["path"], str) or not item["path"]:
                raise CartridgeError("a cartridge's path must be a non-empty string")
            return item["path"]
        cid = item.get("id")
        if not isinstance(cid, str) or not cid:
            raise CartridgeError("a cartridge needs an 'id' (a file in --cartridge-dir) or a 'path'")
        if "/" in cid or "\\" in cid or "\0" in cid or cid.startswith("."):
            raise CartridgeError(f"cartridge id {cid!r} must be a file name in --cartridge-dir, not a path; "
                                 "use the 'path' field for a path")
        if self.cartridge_dir is None:
            raise CartridgeError(f"cartridge id {cid!r} cannot be resolved: no cartridge directory is set "
                                 "(start the engine with --cartridge-dir, or give a 'path')")
        path = os.path.join(self.cartridge_dir, cid if cid.endswith(".safetensors") else f"{cid}.safetensors")
        root = os.path.realpath(self.cartridge_dir)
        if not os.path.realpath(path).startswith(root + os.sep):  # a link out of the directory
            raise CartridgeError(f"cartridge id {cid!r} resolves outside the cartridge directory")
        return path

    def load(self, path: str, force: bool = False) -> Cartridge:
        """The cartridge at `path`, read once (again when the file changed, or `force`) and checked.

        Raises:
            CartridgeError: unreadable, corrupt, or not this model's (`check_cartridge`).
        """
        if not os.path.isfile(path):
            where = f" (ids resolve in {self.cartridge_dir})" if self.cartridge_dir is not None else ""
            raise CartridgeError(f"cartridge file '{path}' does not exist{where}")
        try:
            st = os.stat(path)
        except OSError as e:
            raise CartridgeError(f"cartridge file '{path}' cannot be read: {e.strerror}") from e
        key = (os.path.realpath(path), st.st_mtime, st.st_size)
        cart = None if force else self._loaded.get(key)
        if cart is None:
            cart = load_cartridge(path)
            check_cartridge(cart, self.spec)
            if cart.dtype != self.dtype:
                logger.warning("cartridge '%s' is %s, the KV cache %s: its entries are cast", cart.id, cart.dtype,
                               self.dtype)
            self._loaded[key] = cart
            while len(self._loaded) > MAX_LOADED_CARTRIDGES:
                self._loaded.popitem(last=False)
        self._loaded.move_to_end(key)
        return cart

    def compose(self, items: Sequence[str | dict]) -> CartridgePrefix:
        """The composition of cartridge references `items`, in order.

        Raises:
            CartridgeError: an empty list, a bad or unfitting cartridge, or (hybrid models)
                cartridges that do not form a chain (each built after the one before it).
        """
        if self.unsupported is not None:
            raise CartridgeError(f"cartridges are not supported on {self.unsupported} yet")
        if not isinstance(items, (list, tuple)) or not items:
            raise CartridgeError("cartridges must be a non-empty list")
        parts = []
        for item in items:
            force = isinstance(item, dict) and bool(item.get("force_redownload"))
            path = self.resolve_path(item)
            with self._lock:
                parts.append(self.load(path, force))
        spans, pos = [], 0
        for i, c in enumerate(parts):
            follows = i and (c.base_digest == parts[i - 1].digest if c.base_digest else c.base == parts[i - 1].id)
            if self.spec.state_shapes and (c.position_offset != pos or (i and not follows)):
                raise CartridgeError(
                    f"on a model with linear-attention layers, cartridges compose only as a chain: '{c.id}' was built "
                    f"at position {c.position_offset} after {c.base or 'nothing'!r}, but it would follow "
                    f"{parts[i - 1].id if i else 'nothing'!r} at position {pos}; build it with "
                    f"`moestream cartridge build --after {parts[i - 1].id if i else '...'}`" if i else
                    f"on a model with linear-attention layers, cartridge '{c.id}' continues '{c.base}' and cannot come "
                    "first; put its base before it")
            spans.append((pos, pos + 1, bytes.fromhex(c.digest)))
            pos += c.num_tokens
        return CartridgePrefix(tuple(parts), pos, tuple(spans))

    def route(self, prefix: CartridgePrefix, token_ids: Sequence[int], routing: str | None) -> CartridgeRoute:
        """Whether a request of `token_ids` starts after `prefix`: always, or with "auto" when
        the relevance of some part with a router exceeds its threshold (a part without a
        router counts as relevant).

        Raises:
            CartridgeError: a routing that is not "always" or "auto".
        """
        routing = self.default_routing if routing is None else routing
        if routing not in ROUTING_MODES:
            raise CartridgeError(f"cartridge_routing must be 'always' or 'auto', got {routing!r}")
        ids = tuple(prefix.ids)
        if routing == "always":
            return CartridgeRoute(ids, routing, True, num_tokens=prefix.num_tokens)
        scored = [(c.router.relevance(token_ids), c.router.threshold) for c in prefix.parts if c.router is not None]
        if len(scored) < len(prefix.parts):
            attached, best = True, max(scored, key=lambda s: s[0] - s[1], default=(None, None))
        else:
            best = max(scored, key=lambda s: s[0] - s[1])
            attached = best[0] > best[1]
        return CartridgeRoute(ids, routing, attached, best[0], best[1], prefix.num_tokens)

    # ---- blocks -----------------------------------------------------------------------------

    def _entries(self, prefix: CartridgePrefix) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per attention layer, the composition's keys and values [P, heads, dim] in the KV dtype."""
        flat = self._flat.get(prefix.key)
        if flat is None:
            keys = [torch.cat([c.keys[a] for c in prefix.parts]).to(self.dtype) for a in range(self.spec.num_layers)]
            values = [torch.cat([c.values[a] for c in prefix.parts]).to(self.dtype)
                      for a in range(self.spec.num_layers)]
            flat = self._flat[prefix.key] = (keys, values)
            while len(self._flat) > MAX_LOADED_CARTRIDGES:
                self._flat.popitem(last=False)
        self._flat.move_to_end(prefix.key)
        return flat

    def _write(self, prefix: CartridgePrefix, block: int, lo: int, hi: int) -> None:
        """Write the composition's entries of positions [lo, hi) into slots 0.. of `block`."""
        keys, values = self._entries(prefix)
        for (k_cache, v_cache), k, v in zip(self.kv_caches, keys, values, strict=True):
            k_cache[block, : hi - lo].copy_(k[lo:hi])
            v_cache[block, : hi - lo].copy_(v[lo:hi])

    def block_hashes(self, prefix: CartridgePrefix) -> list[bytes]:
        """The chained hashes of the composition's full blocks (as `KVCacheManager.block_hashes`
        computes them for a request's placeholder positions)."""
        bs, out = self.block_size, []
        for j in range(prefix.num_tokens // bs):
            extra = b"".join(h for start, end, h in prefix.hash_spans if start < (j + 1) * bs and end > j * bs)
            out.append(hash_block(out[-1] if out else b"", [PLACEHOLDER_TOKEN] * bs, extra))
        return out

    def pin(self, request_id: str, prefix: CartridgePrefix) -> list[int] | None:
        """The composition's full blocks for `request_id` (not yet taken by it: they go to
        `allocate_slots` as its prefix hit), written into the pool when not pinned or cached;
        None, taking nothing, when the free pool is too small now."""
        key = self._user_key.get(request_id)
        if key is not None:
            return self._pins[key].blocks
        pin = self._pins.get(prefix.key)
        if pin is None:
            hashes = self.block_hashes(prefix)
            cached = [self.pool.cached_block(h) for h in hashes]
            hits = [b for b in cached if b is not None]
            if len(hashes) - len(hits) > self.pool.num_free_blocks - self.pool.num_free_hits(hits):
                return None
            if len(hits) < len(hashes):
                self._entries(prefix)  # the host copy first: nothing is taken if it fails
            self.pool.touch(hits)
            taken = self.pool.take(len(hashes) - len(hits))
            new, blocks = iter(taken), []
            try:
                for j, (h, b) in enumerate(zip(hashes, cached)):
                    if b is None:
                        b = next(new)
                        self._write(prefix, b, j * self.block_size, (j + 1) * self.block_size)
                        self.pool.cache(b, h)
                        self.num_block_writes += 1
                    else:
                        self.num_block_reuses += 1
                    blocks.append(b)
            except BaseException:
                self.pool.release([*hits, *taken])
                raise
            pin = self._pins[prefix.key] = _Pin(blocks, set())
        pin.users.add(request_id)
        self._user_key[request_id] = prefix.key
        return pin.blocks

    def unpin(self, request_id: str) -> None:
        """`request_id` no longer uses its composition (no-op if it holds none); the last
        user's unpin gives the blocks back to the free queue (cached: evicted LRU)."""
        key = self._user_key.pop(request_id, None)
        if key is None:
            return
        pin = self._pins[key]
        pin.users.discard(request_id)
        if not pin.users:
            del self._pins[key]
            self.pool.release(pin.blocks[::-1])  # the last block is evicted first

    def write_tail(self, prefix: CartridgePrefix, block: int) -> None:
        """Copy the composition's last P mod block_size entries into slots 0.. of `block`."""
        lo = prefix.num_tokens // self.block_size * self.block_size
        if lo < prefix.num_tokens:
            self._write(prefix, block, lo, prefix.num_tokens)

    def stats(self) -> dict:
        """loaded (host copies), pinned (compositions in use), pinned_blocks, block_writes
        (blocks written from host copies), block_reuses (blocks found still cached)."""
        return {"loaded": len(self._loaded), "pinned": len(self._pins),
                "pinned_blocks": sum(len(p.blocks) for p in self._pins.values()),
                "block_writes": self.num_block_writes, "block_reuses": self.num_block_reuses}
