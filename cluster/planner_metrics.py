"""The planner's decisions as Prometheus series (the controller wires this to /metrics).

- ``pdcluster_planner_target_replicas{pool}`` (gauge): the last decision's target.
- ``pdcluster_planner_current_replicas{pool}`` (gauge): the replicas it saw.
- ``pdcluster_planner_needed_replicas{pool}`` (gauge): the load model's fractional count.
- ``pdcluster_planner_decisions_total{pool, direction}`` (counter): up, down or hold.
- ``pdcluster_planner_capacity_correction{phase}`` (gauge): observed/expected latency
  ratio applied to the measured per-replica capacity (1 = as measured).

The reason of every decision goes to the log (``cluster.planner`` logger, INFO for a
change, DEBUG for a hold): reasons are free text, not label values.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from cluster.planner import Planner
from cluster.planner_model import Decision

log = logging.getLogger("cluster.planner")


class PlannerMetrics:
    """Registers the planner series in ``registry``; call :meth:`record` after each
    ``Planner.decide``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.target = Gauge(
            "pdcluster_planner_target_replicas",
            "Replicas the planner wants in each pool",
            ["pool"],
            registry=registry,
        )
        self.current = Gauge(
            "pdcluster_planner_current_replicas",
            "Replicas in each pool when the planner last decided",
            ["pool"],
            registry=registry,
        )
        self.needed = Gauge(
            "pdcluster_planner_needed_replicas",
            "Fractional replicas the planner's load model needs",
            ["pool"],
            registry=registry,
        )
        self.decisions = Counter(
            "pdcluster_planner_decisions",  # exported as pdcluster_planner_decisions_total
            "Planner decisions per pool and direction (up, down, hold)",
            ["pool", "direction"],
            registry=registry,
        )
        self.correction = Gauge(
            "pdcluster_planner_capacity_correction",
            "Observed/expected latency ratio applied to measured capacity",
            ["phase"],
            registry=registry,
        )

    def record(self, decisions: Iterable[Decision], planner: Planner | None = None) -> None:
        for d in decisions:
            self.target.labels(pool=d.pool).set(d.target)
            self.current.labels(pool=d.pool).set(d.current)
            self.needed.labels(pool=d.pool).set(d.needed if d.needed < float("inf") else -1)
            self.decisions.labels(pool=d.pool, direction=d.direction).inc()
            level = logging.INFO if d.direction != "hold" else logging.DEBUG
            log.log(level, "t=%.1f %s %d→%d: %s", d.time_s, d.pool, d.current, d.target, d.reason)
        if planner is not None:
            for phase, value in planner.correction.items():
                self.correction.labels(phase=phase).set(value)
