"""What a simulation returns: per-request latencies, the planner's ticks and decisions, and the
SLO attainment and percentiles read from them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from cluster.planner_model import Decision
from cluster.simulator.cluster_model import SimConfig


@dataclass
class SimResult:
    """Per-request latencies (NaN: did not finish) and per-tick time series."""

    config: SimConfig
    arrival_s: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    end_s: float
    gpu_seconds: float
    ticks: list[dict] = field(default_factory=list)  # one per planner interval
    decisions: list[Decision] = field(default_factory=list)  # changes only

    @property
    def finished(self) -> np.ndarray:
        return ~np.isnan(self.tpot_s)

    def meets_slo(self) -> np.ndarray:
        slo = self.config.slo
        tpot = np.where(np.isnan(self.tpot_s), np.inf, self.tpot_s)
        return (self.ttft_s * 1e3 <= slo.ttft_ms) & (tpot * 1e3 <= slo.tpot_ms)

    def attainment(self) -> float:
        """Fraction of all requests meeting both SLOs (unfinished ones do not)."""
        return float(self.meets_slo().mean()) if len(self.ttft_s) else 1.0

    def percentile(self, which: str, p: float) -> float:
        values = getattr(self, f"{which}_s")
        values = values[~np.isnan(values)]
        return float(np.percentile(values, p)) if len(values) else math.nan

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600.0

    def summary(self) -> dict:
        p = self.config.slo.percentile
        return {
            "requests": len(self.ttft_s),
            "finished": int(self.finished.sum()),
            "attainment": self.attainment(),
            f"ttft_p{p:g}_ms": self.percentile("ttft", p) * 1e3,
            f"tpot_p{p:g}_ms": self.percentile("tpot", p) * 1e3,
            "ttft_p50_ms": self.percentile("ttft", 50) * 1e3,
            "tpot_p50_ms": self.percentile("tpot", 50) * 1e3,
            "gpu_hours": self.gpu_hours,
            "scaling_actions": len(self.decisions),
        }
