"""Expert-cache metrics: hits, misses and hit rate per layer, prefetch hits and wasted
prefetch bytes, bytes read per tier, stall seconds, evictions."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExpertStats:
    """Counters of a PagedExpertStore. Bytes are bytes; seconds are wall-clock seconds.

    A hit is an `ensure`d expert already in a device slot; a prefetch hit is a hit on an
    expert that the prefetcher loaded and nobody had used yet. Wasted prefetch bytes are
    bytes of prefetched experts evicted before any use. Each tier counts the bytes it
    served in its own format: disk in the checkpoint's dtype, host in the compute dtype;
    prefetch bytes are disk bytes. A stall is time `ensure` spends
    waiting for loads (demand misses and in-flight prefetches). prefetch_errors: prefetch
    reads that raised (logged; the expert is then loaded on demand). host_computed: misses
    computed from the host cache where they lie (no copy, no slot). With the page-cache
    prefetch target, a prefetch load is a read-ahead request to the kernel and its bytes are
    the bytes advised: they are not counted as read, and there are no prefetch hits or
    wasted bytes (the demand miss reads them from the page cache).
    """

    num_layers: int
    hits: list[int] = field(default_factory=list)
    misses: list[int] = field(default_factory=list)
    evictions: list[int] = field(default_factory=list)
    prefetch_hits: int = 0
    prefetch_loads: int = 0
    prefetch_bytes: int = 0
    wasted_prefetch_bytes: int = 0
    prefetch_errors: int = 0
    host_computed: int = 0
    bytes_read_disk: int = 0
    bytes_read_host: int = 0
    stall_seconds: float = 0.0

    def __post_init__(self) -> None:
        for name in ("hits", "misses", "evictions"):
            if not getattr(self, name):
                setattr(self, name, [0] * self.num_layers)

    def as_dict(self) -> dict:
        """Flat dict for Python callers and Prometheus exporters."""
        hits, misses = sum(self.hits), sum(self.misses)
        return {
            "resident": False,
            "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
            "hits": hits,
            "misses": misses,
            "hit_rate_per_layer": [h / (h + m) if h + m else 1.0 for h, m in zip(self.hits, self.misses)],
            "hits_per_layer": list(self.hits),
            "misses_per_layer": list(self.misses),
            "evictions": sum(self.evictions),
            "evictions_per_layer": list(self.evictions),
            "prefetch_hits": self.prefetch_hits,
            "prefetch_loads": self.prefetch_loads,
            "prefetch_bytes": self.prefetch_bytes,
            "wasted_prefetch_bytes": self.wasted_prefetch_bytes,
            "prefetch_errors": self.prefetch_errors,
            "host_computed": self.host_computed,
            "bytes_read": self.bytes_read_disk + self.bytes_read_host,
            "bytes_read_per_tier": {"disk": self.bytes_read_disk, "host": self.bytes_read_host},
            "stall_seconds": self.stall_seconds,
        }
