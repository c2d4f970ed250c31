"""Prometheus metrics of one server, in its own `CollectorRegistry` (names as vLLM's, with
the `moestream:` prefix).

Counted on the event loop as outputs are routed: requests finished (by reason), prompt
and generation tokens, HTTP responses (by path and status); histograms of TTFT, TPOT,
ITL and end-to-end latency (seconds). Read at scrape time from the engine thread's
latest `EngineSnapshot`: running / waiting requests, KV blocks in use, prefix-cache queries
and hits (tokens), the expert store's hit rate, stall seconds and bytes read per tier, and
an approximate expert mode's folded weight, dropped pairs and misses avoided.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from moestream.outputs import RequestOutput
from moestream.server.async_engine import EngineSnapshot

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)

# `ExpertMode.stats` keys exported as counters moestream:expert_mode_KEY
_EXPERT_MODE_COUNTERS = (
    ("routed_weight", "Routing weight of the tokens in the approximate expert mode."),
    ("folded_weight", "Routing weight the approximate expert mode folded onto other experts or dropped."),
    ("routed_pairs", "(token, expert) pairs routed for the tokens in the approximate expert mode."),
    ("dropped_pairs", "(token, expert) pairs the approximate expert mode did not compute."),
    ("misses_avoided", "Experts per MoE layer call the approximate expert mode left uncomputed (reads avoided "
                       "when paged)."),
)


class _EngineCollector(Collector):
    """Gauges and counters read from the engine's latest snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], queued: Callable[[], int]) -> None:
        self._snapshot = snapshot
        self._queued = queued

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        yield GaugeMetricFamily("moestream:num_requests_running", "Requests in the running batch.", s.num_running)
        yield GaugeMetricFamily("moestream:num_requests_waiting", "Requests queued in the scheduler.", s.num_waiting)
        yield GaugeMetricFamily("moestream:num_requests_queued",
                                "Requests accepted that have not produced their first token yet "
                                "(what --max-waiting-requests limits).", self._queued())
        used = s.num_blocks - s.num_free_blocks
        yield GaugeMetricFamily("moestream:kv_cache_blocks_in_use", "KV cache blocks in use.", used)
        yield GaugeMetricFamily("moestream:kv_cache_blocks_total", "KV cache blocks in all.", s.num_blocks)
        yield GaugeMetricFamily("moestream:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
                                used / s.num_blocks if s.num_blocks else 0.0)
        groups = GaugeMetricFamily("moestream:kv_cache_group_blocks",
                                   "KV cache blocks held by requests, per KV cache group (full / sliding window).",
                                   labels=["group"])
        for g in s.kv_groups:
            groups.add_metric([g["kind"]], float(g["used_blocks"]))
        yield groups
        x = s.expert_stats
        yield GaugeMetricFamily("moestream:expert_hit_rate",
                                "Fraction of routed-expert accesses served from a device slot (1 when all resident).",
                                float(x.get("hit_rate", 1.0)))
        yield CounterMetricFamily("moestream:expert_hits", "Routed-expert accesses served from a device slot.",
                                  float(x.get("hits", 0)))
        yield CounterMetricFamily("moestream:expert_misses", "Routed-expert accesses that had to load the expert.",
                                  float(x.get("misses", 0)))
        yield CounterMetricFamily("moestream:expert_stall_seconds",
                                  "Seconds the forward pass waited for expert loads.", float(x.get("stall_seconds", 0.0)))
        tiers = CounterMetricFamily("moestream:expert_bytes_read", "Expert bytes read, by the tier that served them.",
                                    labels=["tier"])
        per_tier = x.get("bytes_read_per_tier", {})
        for tier in ("disk", "host"):
            tiers.add_metric([tier], float(per_tier.get(tier, 0)))
        yield tiers
        mode = x.get("expert_mode")
        if mode is not None:  # an approximate expert mode (docs/expert_modes.md)
            for key, text in _EXPERT_MODE_COUNTERS:
                yield CounterMetricFamily(f"moestream:expert_mode_{key}", text, float(mode[key]))
            if "activated_per_token" in mode:  # EAT
                g = GaugeMetricFamily("moestream:expert_mode_activated_experts",
                                      "Mean experts computed per token in the approximate expert mode, by MoE layer.",
                                      labels=["layer"])
                for layer, value in mode["activated_per_token"].items():
                    g.add_metric([str(layer)], float(value))
                yield g
        pc = s.prefix_cache_stats
        if pc.get("enabled"):
            yield CounterMetricFamily("moestream:prefix_cache_queries",
                                      "Prompt tokens of admitted requests looked up in the prefix cache.",
                                      float(pc.get("queries", 0)))
            yield CounterMetricFamily("moestream:prefix_cache_hits",
                                      "Prompt tokens found in the prefix cache (not computed).", float(pc.get("hits", 0)))
            yield GaugeMetricFamily("moestream:prefix_cache_blocks", "KV blocks held in the prefix cache.",
                                    float(pc.get("cached_blocks", 0)))
            if "checkpoints_device" in pc:  # hybrid models: linear-attention state checkpoints
                count = GaugeMetricFamily("moestream:prefix_cache_state_checkpoints",
                                          "Linear-attention state checkpoints in the prefix cache, by tier.",
                                          labels=["tier"])
                size = GaugeMetricFamily("moestream:prefix_cache_state_checkpoint_bytes",
                                         "Bytes of linear-attention state checkpoints, by tier.", labels=["tier"])
                for tier in ("device", "host"):
                    count.add_metric([tier], float(pc[f"checkpoints_{tier}"]))
                    size.add_metric([tier], float(pc[f"checkpoint_bytes_{tier}"]))
                yield count
                yield size
                yield CounterMetricFamily("moestream:prefix_cache_recomputed_tokens",
                                          "Prompt tokens whose KV blocks were cached but were computed again from "
                                          "the last state checkpoint (hybrid models).",
                                          float(pc.get("recomputed_tokens", 0)))
        sd = s.spec_decode_stats
        if sd.get("enabled"):  # vLLM's names
            yield CounterMetricFamily("moestream:spec_decode_num_drafts", "Decode steps of a request that verified drafts.",
                                      float(sd["num_drafts"]))
            yield CounterMetricFamily("moestream:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                      float(sd["num_draft_tokens"]))
            yield CounterMetricFamily("moestream:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                      float(sd["num_accepted_tokens"]))
            per_pos = CounterMetricFamily("moestream:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted at each draft position (0-based).",
                                          labels=["position"])
            for j, n in enumerate(sd["num_accepted_tokens_per_pos"]):
                per_pos.add_metric([str(j)], float(n))
            yield per_pos
        if s.num_state_slots:
            yield GaugeMetricFamily("moestream:state_slots_total",
                                    "Device slots for linear-attention states (hybrid models).", s.num_state_slots)
            yield GaugeMetricFamily("moestream:state_slots_in_use",
                                    "Requests whose linear-attention state is on the device.", s.num_resident_states)
            yield GaugeMetricFamily("moestream:states_swapped",
                                    "Requests whose linear-attention state waits in host memory.", s.num_swapped_states)
            yield CounterMetricFamily("moestream:state_swap_ins",
                                      "Linear-attention states swapped back in from host memory.", s.num_state_swap_ins)


class ServerMetrics:
    """The server's metrics; an `OutputObserver` of the `AsyncLLMEngine`.

    `bind(snapshot, queued)` attaches the engine-side gauges once the engine exists.
    """

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("moestream:request_success", "Engine requests finished, by finish reason "
                                "(stop, length, abort).", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("moestream:prompt_tokens", "Prompt tokens of requests that were prefilled.",
                                     registry=r)
        self.cartridge_requests = Counter("moestream:cartridge_requests", "Finished engine requests that named "
                                          "cartridges, by routing (always, auto) and decision (attached, skipped).",
                                          ["routing", "decision"], registry=r)
        self.generation_tokens = Counter("moestream:generation_tokens", "Tokens generated.", registry=r)
        self.http = Counter("moestream:http_requests", "HTTP responses, by route and status code.",
                            ["path", "status"], registry=r)
        self.ttft = Histogram("moestream:time_to_first_token_seconds", "Time to first token (s).",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("moestream:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request (s).",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("moestream:inter_token_latency_seconds", "Time between a request's tokens (s).",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("moestream:e2e_request_latency_seconds", "Arrival to finish, per request (s).",
                             buckets=_E2E_BUCKETS, registry=r)

    def bind(self, snapshot: Callable[[], EngineSnapshot], queued: Callable[[], int]) -> None:
        """Register the engine-snapshot collector (call once)."""
        self.registry.register(_EngineCollector(snapshot, queued))

    def on_output(self, output: RequestOutput, previous: RequestOutput | None) -> None:
        """Count the tokens `output` added since `previous` and observe its latencies."""
        m = output.metrics
        prev_tokens = len(previous.outputs[0].token_ids) if previous is not None else 0
        new_tokens = len(output.outputs[0].token_ids) - prev_tokens
        if new_tokens > 0:
            self.generation_tokens.inc(new_tokens)
            if prev_tokens == 0:
                self.prompt_tokens.inc(len(output.prompt_token_ids))
                if m.ttft is not None:
                    self.ttft.observe(m.ttft)
            elif m.last_token_time is not None and previous.metrics.last_token_time is not None:
                self.itl.observe(m.last_token_time - previous.metrics.last_token_time)
        if output.finished:
            self.requests.labels(output.outputs[0].finish_reason or "abort").inc()
            route = output.cartridges
            if route is not None:
                self.cartridge_requests.labels(route.routing, "attached" if route.attached else "skipped").inc()
            if m.tpot is not None:
                self.tpot.observe(m.tpot)
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)

    def on_abort(self, num_requests: int) -> None:
        """Count `num_requests` requests aborted because their client went away."""
        self.requests.labels("abort").inc(num_requests)

    def on_http_response(self, path: str, status: int) -> None:
        """Count one HTTP response of `status` on route `path` ("other" for unknown paths)."""
        self.http.labels(path, str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
