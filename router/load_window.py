"""A rolling record of finished requests, for the planner's view of the load: arrival rate,
prompt/output lengths, TTFT and TPOT percentiles over the last window."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSample:
    arrival: float  # monotonic
    input_len: int
    output_len: int
    ttft_s: float | None
    tpot_s: float | None
    ok: bool
    replicas: tuple[str, ...]  # the actors that served it (to drop samples of warming ones)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, math.ceil(q / 100.0 * len(ordered)) - 1)
    return ordered[rank]


class LoadWindow:
    def __init__(self, horizon_s: float = 600.0, max_samples: int = 100_000) -> None:
        self.horizon_s = horizon_s
        self._samples: deque[RequestSample] = deque(maxlen=max_samples)
        self._arrivals: deque[float] = deque(maxlen=max_samples)

    def arrived(self, now: float | None = None) -> None:
        self._arrivals.append(time.monotonic() if now is None else now)

    def finished(self, sample: RequestSample) -> None:
        self._samples.append(sample)

    def summary(
        self,
        window_s: float,
        percentile_q: float,
        exclude: set[str] = frozenset(),
        now: float | None = None,
    ) -> dict:
        """Load over the last ``window_s``; latency samples from actors in ``exclude``
        (warming up) are left out."""
        now = time.monotonic() if now is None else now
        start = now - window_s
        while self._arrivals and self._arrivals[0] < now - self.horizon_s:
            self._arrivals.popleft()
        while self._samples and self._samples[0].arrival < now - self.horizon_s:
            self._samples.popleft()
        arrivals = sum(1 for t in self._arrivals if t >= start)
        recent = [s for s in self._samples if s.arrival >= start]
        clean = [s for s in recent if s.ok and not exclude.intersection(s.replicas)]
        ttft = [s.ttft_s * 1000 for s in clean if s.ttft_s is not None]
        tpot = [s.tpot_s * 1000 for s in clean if s.tpot_s is not None]
        return {
            "window_s": window_s,
            "arrival_rate": arrivals / window_s if window_s > 0 else 0.0,
            "finished": len(recent),
            "failed": sum(1 for s in recent if not s.ok),
            "mean_input_len": sum(s.input_len for s in recent) / len(recent) if recent else 0.0,
            "mean_output_len": sum(s.output_len for s in recent) / len(recent) if recent else 0.0,
            "ttft_ms": percentile(ttft, percentile_q),
            "tpot_ms": percentile(tpot, percentile_q),
            "ttft_samples": len(ttft),
            "tpot_samples": len(tpot),
        }

    def attainment(
        self, window_s: float, ttft_ms: float, tpot_ms: float, now: float | None = None
    ) -> float | None:
        """Fraction of requests finished in the window that met both SLOs."""
        now = time.monotonic() if now is None else now
        recent = [s for s in self._samples if s.arrival >= now - window_s]
        if not recent:
            return None
        met = sum(
            1
            for s in recent
            if s.ok
            and (s.ttft_s or 0) * 1000 <= ttft_ms
            and (s.tpot_s is None or s.tpot_s * 1000 <= tpot_ms)
        )
        return met / len(recent)
