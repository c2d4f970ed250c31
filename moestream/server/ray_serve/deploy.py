"""`build_ray_app` (the Ray Serve application: N engine replicas behind one OpenAI ingress)
and `serve_ray` (`moestream serve MODEL --ray`)."""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from typing import Any

from moestream.config import EngineConfig
from moestream.server.serving import ServerConfig

logger = logging.getLogger("moestream")

APP_NAME = "moestream"


@dataclass(frozen=True)
class RayConfig:
    """Ray Serve settings of `moestream serve --ray`.

    Attributes:
        num_replicas: engine replicas (ignored when autoscaling).
        min_replicas, max_replicas: autoscaling bounds; setting max_replicas turns Ray Serve's
            autoscaler on (`target_ongoing_requests` per replica).
        target_ongoing_requests: autoscaling target of requests in flight per replica.
        max_ongoing_requests: requests one replica takes at once (more wait in the router, or go
            to another replica); None = the engine's max_num_seqs (more would only queue in
            the engine, where no other replica can take them).
        num_cpus: CPUs reserved per engine replica.
        imbalanced_threshold: queue-length difference between replicas above which the
            router balances load instead of following the prefix (PrefixCacheAffinityRouter's
            `imbalanced_threshold`).
        match_rate_threshold: smallest matched fraction of a prompt worth following.
        address: a Ray cluster to join ("auto" or "ray://host:10001"); None starts a new local one
            (never joins a cluster already running here).
    """

    num_replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    max_ongoing_requests: int | None = None
    num_cpus: float = 1.0
    imbalanced_threshold: float = 8.0
    match_rate_threshold: float = 0.1
    address: str | None = None

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--num-replicas must be at least 1, got {self.num_replicas}")
        if self.max_replicas is not None and self.max_replicas < max(1, self.min_replicas or 0):
            raise ValueError(f"--max-replicas ({self.max_replicas}) must be at least --min-replicas "
                             f"({self.min_replicas}) and 1")
        if self.target_ongoing_requests <= 0 or (self.max_ongoing_requests is not None and self.max_ongoing_requests < 1):
            raise ValueError("--target-ongoing-requests must be positive and --max-ongoing-requests at least 1")


def build_ray_app(engine_config: EngineConfig, server_config: ServerConfig, ray_config: RayConfig,
                  max_model_len: int, collector: Any = None) -> Any:
    """The bound Ray Serve application: `EngineReplica` x N (prefix-affinity routed,
    autoscaled when `max_replicas` is set) behind `OpenAIIngress`."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from moestream.server.ray_serve.ingress import OpenAIIngress
    from moestream.server.ray_serve.replica import EngineReplica
    from moestream.server.ray_serve.router import PrefixAffinityRouter

    rc = ray_config
    scaling: dict[str, Any] = {"num_replicas": rc.num_replicas}
    if rc.max_replicas is not None:
        scaling = {"autoscaling_config": {"min_replicas": rc.min_replicas or 1, "max_replicas": rc.max_replicas,
                                          "target_ongoing_requests": rc.target_ongoing_requests}}
    replicas = serve.deployment(EngineReplica).options(
        name="EngineReplica", max_ongoing_requests=rc.max_ongoing_requests or engine_config.max_num_seqs, ray_actor_options={"num_cpus": rc.num_cpus},
        health_check_period_s=5, request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"imbalanced_threshold": rc.imbalanced_threshold,
                                   "match_rate_threshold": rc.match_rate_threshold}),
        **scaling,
    ).bind(engine_config, server_config, collector)
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress", max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
    return ingress.bind(replicas, server_config, max_model_len, collector)


def start_collector() -> Any:
    """A `MetricsCollector` actor owned by this process (it lives as long as the driver)."""
    import ray

    from moestream.server.ray_serve.metrics import MetricsCollector

    return ray.remote(num_cpus=0)(MetricsCollector).remote()


def serve_ray(engine_config: EngineConfig, server_config: ServerConfig, ray_config: RayConfig, max_model_len: int,
              host: str, port: int) -> int:
    """Deploy on Ray Serve and block until interrupted (Ctrl-C / SIGTERM); then shut the
    application down (requests still in flight are cancelled) and the local Ray cluster, if
    this started it. Returns 0.

    Raises:
        ValueError: Ray is not installed (the `.[ray]` extra).
    """
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError('--ray needs Ray Serve: pip install -e ".[ray]"') from None
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    ray.init(address=ray_config.address or "local", include_dashboard=False, log_to_driver=True)
    # After ray.init, which installs its own SIGTERM handler (a crash dump and abort): SIGTERM
    # shuts down as Ctrl-C does, Ray's processes included.
    signal.signal(signal.SIGTERM, interrupt)
    try:
        serve.start(http_options={"host": host, "port": port})
        collector = start_collector()
        serve.run(build_ray_app(engine_config, server_config, ray_config, max_model_len, collector),
                  name=APP_NAME, route_prefix="/")
        logger.info("moestream on Ray Serve: %d replica(s) at http://%s:%d", ray_config.num_replicas, host, port)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
