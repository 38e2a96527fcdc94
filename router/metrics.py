"""The router's Prometheus metrics, in a registry of its own (one per app, so tests and
several routers in one process do not collide).

Series (the planner in cluster/ reads these names):

- ``pdcluster_router_ttft_seconds`` (histogram): arrival at the router → first token.
- ``pdcluster_router_tpot_seconds`` (histogram): (last token − first token) / (tokens − 1),
  one observation per request with at least two tokens.
- ``pdcluster_router_e2e_latency_seconds`` (histogram): arrival → last token.
- ``pdcluster_router_ttft_stage_seconds{stage}`` (histogram): where the time to first token
  went, per stage of ``router.timeline`` (queue, reserve, prefill_queue, prefill,
  kv_transfer, prefill_rpc, first_delivery).
- ``pdcluster_router_ttft_forecast_error_seconds`` (histogram): measured − forecast TTFT
  of each request SLO-aware admission let in (negative: it came sooner than forecast).
- ``pdcluster_router_requests_total{api, status}``: status is ok, cancelled (client went
  away), aborted (a worker aborted it), error, rejected_400, rejected_404, rejected_413,
  unauthorized, overloaded (429) or no_replica (503).
- ``pdcluster_router_prompt_tokens_total``, ``pdcluster_router_generation_tokens_total``.
- ``pdcluster_router_requests_in_flight`` (gauge).
- From ``Backend.stats()`` at scrape time: ``pdcluster_queue_tokens{actor}``,
  ``pdcluster_running_requests{actor}``, ``pdcluster_kv_usage{actor}`` (fraction),
  ``pdcluster_decode_slot_limit{actor}`` (SLO-aware admission's limit per decode actor),
  ``pdcluster_kv_transfer_bytes_total``, ``pdcluster_kv_transfer_seconds_total``,
  ``pdcluster_kv_transfers_total``, ``pdcluster_prefills_total``, the same by transport
  (``pdcluster_kv_transport_{transfers,bytes,seconds}_total{transport}``),
  ``pdcluster_prefix_cache_queries_total{actor}`` and ``pdcluster_prefix_cache_hits_total{actor}``
  (prompt tokens looked up in each actor's prefix cache and found there, as vLLM counts them),
  ``pdcluster_kv_index_blocks{actor}`` (blocks the router's index says each actor caches),
  ``pdcluster_router_prefill_routing_total{reason}`` (prefill choices: overlap, load, fallback,
  hash; router/prefill_routing.py), ``pdcluster_router_prefill_path_total{path}`` (prompts
  prefilled on a prefill replica, remote, or on their decode replica, local), and any
  other numeric key as ``pdcluster_backend_<key>`` (e.g. ``router_waiting``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.backend import Backend

log = logging.getLogger(__name__)

# Seconds. TTFT spans a queued long prompt; TPOT is tens of milliseconds at most when healthy.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1)
FORECAST_ERROR_BUCKETS = (-5, -2, -1, -0.5, -0.25, -0.1, -0.05, 0, 0.05, 0.1, 0.25, 0.5, 1, 2, 5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class RouterMetrics:
    def __init__(self, backend: Backend | None = None) -> None:
        self.extra_exposition = b""  # Prometheus text set by other components (the controller)
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "pdcluster_router_ttft_seconds",
            "Time to first token, from arrival at the router",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pdcluster_router_tpot_seconds",
            "Time per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdcluster_router_e2e_latency_seconds",
            "Arrival at the router to the last token",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.ttft_stages = Histogram(
            "pdcluster_router_ttft_stage_seconds",
            "Time to first token by stage of its way (router/timeline.py)",
            ["stage"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.ttft_forecast_error = Histogram(
            "pdcluster_router_ttft_forecast_error_seconds",
            "Measured minus forecast time to first token (SLO-aware admission)",
            buckets=FORECAST_ERROR_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "pdcluster_router_requests",
            "Requests by API and outcome",
            ["api", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdcluster_router_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter(
            "pdcluster_router_generation_tokens", "Tokens generated", registry=r
        )
        self.in_flight = Gauge(
            "pdcluster_router_requests_in_flight", "Requests being generated", registry=r
        )
        if backend is not None:
            r.register(_BackendStatsCollector(backend))

    @classmethod
    def of(cls, backend: Backend) -> RouterMetrics:
        """The metrics of ``backend``'s router, made on first use, so that the HTTP and the
        gRPC API count into the one registry that /metrics shows."""
        metrics = getattr(backend, "_router_metrics", None)
        if metrics is None:
            metrics = cls(backend)
            backend._router_metrics = metrics
        return metrics

    def count(self, api: str, status: str) -> None:
        self.requests.labels(api=api, status=status).inc()

    def observe_request(
        self,
        arrival: float,
        first_token: float | None,
        last_token: float | None,
        num_output_tokens: int,
    ) -> None:
        """Latencies of one finished request (times from time.monotonic())."""
        if first_token is None or last_token is None:
            return
        self.ttft.observe(first_token - arrival)
        self.e2e.observe(last_token - arrival)
        if num_output_tokens >= 2:
            self.tpot.observe((last_token - first_token) / (num_output_tokens - 1))

    def observe_stages(self, stages: dict[str, float]) -> None:
        for stage, seconds in stages.items():
            self.ttft_stages.labels(stage=stage).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type (plus series other components
        publish through the router, e.g. the planner's)."""
        return generate_latest(self.registry) + self.extra_exposition, CONTENT_TYPE_LATEST


class _BackendStatsCollector(Collector):
    """Reads ``backend.stats()`` at scrape time, so the gauges are never stale."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def describe(self) -> list[Metric]:
        return []  # dynamic: no fixed description, so the registry never calls collect early

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.backend.stats() or {}
        except Exception:  # a scrape must not fail because one gauge source did
            log.exception("backend.stats() failed")
            return
        per_actor = (
            ("queue_tokens", "pdcluster_queue_tokens", "Prompt tokens queued per actor"),
            ("running", "pdcluster_running_requests", "Requests running per actor"),
            ("kv_usage", "pdcluster_kv_usage", "Fraction of KV cache blocks in use per actor"),
            (
                "slot_limit",
                "pdcluster_decode_slot_limit",
                "Requests a decode actor may serve at once under SLO-aware admission",
            ),
            (
                "kv_index_blocks",
                "pdcluster_kv_index_blocks",
                "Blocks the router's index says each actor caches",
            ),
        )
        for key, name, doc in per_actor:
            family = GaugeMetricFamily(name, doc, labels=["actor"])
            for actor, value in sorted((stats.get(key) or {}).items()):
                family.add_metric([str(actor)], float(value))
            yield family
        counters = (
            ("transfer_bytes_total", "pdcluster_kv_transfer_bytes", "KV bytes moved"),
            ("transfer_seconds_total", "pdcluster_kv_transfer_seconds", "Time moving KV"),
            ("transfers_total", "pdcluster_kv_transfers", "KV transfers completed"),
            ("prefills_total", "pdcluster_prefills", "Prefills completed (one per prompt, any n)"),
        )
        for key, name, doc in counters:
            if key in stats:
                yield CounterMetricFamily(name, doc, value=float(stats[key]))
        per_transport = (
            (
                "transport_transfers",
                "pdcluster_kv_transport_transfers",
                "KV transfers by transport",
            ),
            ("transport_bytes", "pdcluster_kv_transport_bytes", "KV bytes moved by transport"),
            ("transport_seconds", "pdcluster_kv_transport_seconds", "Time moving KV by transport"),
        )
        labelled_counters = (
            (
                "prefix_cache_queries",
                "pdcluster_prefix_cache_queries",
                "Prompt tokens looked up in the actor's prefix cache",
                "actor",
            ),
            (
                "prefix_cache_hits",
                "pdcluster_prefix_cache_hits",
                "Prompt tokens found in the actor's prefix cache",
                "actor",
            ),
            (
                "prefill_routing",
                "pdcluster_router_prefill_routing",
                "Prefill routing choices by reason",
                "reason",
            ),
            (
                "prefill_path",
                "pdcluster_router_prefill_path",
                "Prompts prefilled on a prefill replica (remote) or on their decode replica (local)",
                "path",
            ),
        )
        per_transport = tuple((*entry, "transport") for entry in per_transport)
        for key, name, doc, label in per_transport + labelled_counters:
            family = CounterMetricFamily(name, doc, labels=[label])
            for value_label, value in sorted((stats.get(key) or {}).items()):
                family.add_metric([str(value_label)], float(value))
            yield family
        known = {entry[0] for entry in per_actor + counters + per_transport + labelled_counters}
        for key, value in sorted(stats.items()):
            if key in known or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if key.replace("_", "").isalnum():
                yield GaugeMetricFamily(f"pdcluster_backend_{key}", f"backend stat {key}", value)
