"""Per-replica Prometheus metrics on Ray Serve: each engine replica pushes its `/metrics`
text to one `MetricsCollector` actor every `PUSH_INTERVAL_S`; the ingress's `/metrics`
merges them, each series labelled with its replica (`merge_metrics`)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

# Seconds between a replica's pushes; a replica silent for STALE_AFTER_S is dropped (it died),
# and the ingress's /health fails when none pushed within ALIVE_WITHIN_S.
PUSH_INTERVAL_S = 1.0
STALE_AFTER_S = 10.0
ALIVE_WITHIN_S = 3.0


class MetricsCollector:
    """A Ray actor holding the latest metrics text of each replica (bytes, Prometheus text
    format), keyed by replica id."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, bytes]] = {}

    def push(self, replica: str, text: bytes) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def drop(self, replica: str) -> None:
        self._texts.pop(replica, None)

    def num_alive(self, within_s: float) -> int:
        """Replicas that pushed in the last `within_s` seconds."""
        now = time.monotonic()
        return sum(1 for at, _ in self._texts.values() if now - at <= within_s)

    def texts(self) -> dict[str, bytes]:
        """The replicas' latest texts, those silent for STALE_AFTER_S left out."""
        now = time.monotonic()
        return {r: t for r, (at, t) in self._texts.items() if now - at <= STALE_AFTER_S}


class _Labelled(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_metrics(own: bytes, replicas: dict[str, bytes], own_families: frozenset[str]) -> bytes:
    """The ingress's series of the families named in `own_families` (e.g. the HTTP counters,
    which only the ingress sees; unlabelled), then every other family from the replicas, each
    sample with a `replica` label; one family per metric name. A family's name is matched
    with or without its `_total` / `_created` suffix.

    Raises:
        ValueError: a text that is not in the Prometheus text format.
    """
    merged: dict[str, Metric] = {}
    order: list[str] = []
    def ingress_only(name: str) -> bool:
        return name in own_families or name.removesuffix("_total") in own_families or \
            name.removesuffix("_created") in own_families

    for replica, text in [(None, own)] + sorted(replicas.items()):
        for family in text_string_to_metric_families(text.decode()):
            if ingress_only(family.name) != (replica is None):
                continue
            if family.name not in merged:
                merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                order.append(family.name)
            target = merged[family.name]
            for s in family.samples:
                labels = dict(s.labels) if replica is None else {**s.labels, "replica": replica}
                target.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Labelled([merged[n] for n in order]))
    return generate_latest(registry)
