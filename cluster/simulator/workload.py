"""Request streams for the simulator: from a trace file or generated (Poisson, bursts,
diurnal), as three numpy arrays (arrival time, input length, output length).

Length distributions use ``pdcluster bench serve``'s syntax, plus two heavy-tailed ones:
``128`` (fixed), ``uniform:LO:HI``, ``normal:MEAN:STD``, ``exp:MEAN``,
``lognormal:MEAN:SIGMA`` (MEAN is the distribution's mean; SIGMA of the log).

Trace files: CSV with a header containing ``arrival_s,input_len,output_len`` (extra
columns ignored), or JSON lines with those keys. Arrival times need not be sorted.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Workload:
    arrival_s: np.ndarray  # [N] float64, sorted
    input_len: np.ndarray  # [N] int64 >= 1
    output_len: np.ndarray  # [N] int64 >= 1

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.input_len) != n or len(self.output_len) != n:
            raise ValueError("arrival_s, input_len and output_len must have the same length")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0

    @property
    def rate(self) -> float:
        return len(self) / self.duration_s if self.duration_s > 0 else 0.0

    def save_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["arrival_s", "input_len", "output_len"])
            for row in zip(self.arrival_s, self.input_len, self.output_len, strict=True):
                w.writerow([f"{row[0]:.4f}", int(row[1]), int(row[2])])


LengthSampler = Callable[[np.random.Generator, int], np.ndarray]


def parse_length(spec: str) -> LengthSampler:
    """A vectorised sampler of token lengths (each >= 1) from a distribution spec."""
    kind, *args = str(spec).split(":")
    try:
        values = [float(a) for a in args]
        if not args:
            n = int(kind)
            if n < 1:
                raise ValueError
            return lambda rng, size: np.full(size, n, dtype=np.int64)
        if kind == "uniform" and len(values) == 2 and 1 <= values[0] <= values[1]:
            lo, hi = int(values[0]), int(values[1])
            return lambda rng, size: rng.integers(lo, hi + 1, size)
        if kind == "normal" and len(values) == 2 and values[1] >= 0:
            mu, sd = values
            return lambda rng, size: np.maximum(1, np.rint(rng.normal(mu, sd, size))).astype(
                np.int64
            )
        if kind == "exp" and len(values) == 1 and values[0] > 0:
            mean = values[0]
            return lambda rng, size: np.maximum(1, np.rint(rng.exponential(mean, size))).astype(
                np.int64
            )
        if kind == "lognormal" and len(values) == 2 and values[0] > 0 and values[1] >= 0:
            mean, sigma = values
            mu = math.log(mean) - sigma**2 / 2  # so that E[X] = mean
            return lambda rng, size: np.maximum(1, np.rint(rng.lognormal(mu, sigma, size))).astype(
                np.int64
            )
    except ValueError:
        pass
    raise ValueError(
        f"bad length distribution {spec!r}: use N, uniform:LO:HI, normal:MEAN:STD, exp:MEAN "
        "or lognormal:MEAN:SIGMA"
    )


def _lengths(rng, n: int, input_len: str, output_len: str) -> tuple[np.ndarray, np.ndarray]:
    return parse_length(input_len)(rng, n), parse_length(output_len)(rng, n)


def poisson(
    rate: float, duration_s: float, input_len: str, output_len: str, seed: int = 0
) -> Workload:
    """Open-loop Poisson arrivals at ``rate`` req/s for ``duration_s``."""
    return rate_pattern(
        lambda t: np.full_like(t, rate), rate, duration_s, input_len, output_len, seed
    )


def rate_pattern(
    rate_fn: Callable[[np.ndarray], np.ndarray],
    peak_rate: float,
    duration_s: float,
    input_len: str,
    output_len: str,
    seed: int = 0,
) -> Workload:
    """A non-homogeneous Poisson process of rate ``rate_fn(t) <= peak_rate`` (by thinning)."""
    rng = np.random.default_rng(seed)
    if peak_rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    n = rng.poisson(peak_rate * duration_s)
    t = np.sort(rng.uniform(0.0, duration_s, n))
    keep = rng.uniform(0.0, peak_rate, n) < rate_fn(t)
    t = t[keep]
    inp, out = _lengths(rng, len(t), input_len, output_len)
    return Workload(t, inp, out)


def diurnal_rate(
    mean_rate: float, amplitude: float = 0.6, period_s: float = 86400.0, phase_s: float = 0.0
):
    """Daily sinusoid: ``mean · (1 + amplitude · sin)``, trough at ``phase_s`` (night)."""
    return lambda t: (
        mean_rate * (1.0 - amplitude * np.cos(2 * np.pi * (np.asarray(t) - phase_s) / period_s))
    )


def burst_rate(base_rate: float, factor: float, start_s: float, length_s: float):
    """``base_rate``, times ``factor`` during ``[start_s, start_s + length_s)``."""
    return lambda t: np.where(
        (np.asarray(t) >= start_s) & (np.asarray(t) < start_s + length_s),
        base_rate * factor,
        base_rate,
    )


def generate(
    pattern: str, rate: float, duration_s: float, input_len: str, output_len: str, seed: int = 0
) -> Workload:
    """``poisson``, ``diurnal`` (rate is the mean; one period over ``duration_s``) or
    ``burst`` (3x the rate over the middle tenth of the run)."""
    if pattern == "poisson":
        return poisson(rate, duration_s, input_len, output_len, seed)
    if pattern == "diurnal":
        fn = diurnal_rate(rate, 0.6, duration_s)
        return rate_pattern(fn, rate * 1.6, duration_s, input_len, output_len, seed)
    if pattern == "burst":
        fn = burst_rate(rate, 3.0, 0.45 * duration_s, 0.1 * duration_s)
        return rate_pattern(fn, rate * 3.0, duration_s, input_len, output_len, seed)
    raise ValueError(f"unknown pattern {pattern!r}: poisson, diurnal or burst")


def load_trace(path: str | Path) -> Workload:
    """A trace file (CSV or JSON lines, see module doc)."""
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    with open(path) as f:
        if path.suffix in (".jsonl", ".json"):
            for i, line in enumerate(f, 1):
                if line.strip():
                    rows.append(_row(json.loads(line), f"{path}:{i}"))
        else:
            for i, rec in enumerate(csv.DictReader(f), 2):
                rows.append(_row(rec, f"{path}:{i}"))
    if not rows:
        raise ValueError(f"{path}: no requests")
    data = np.array(rows, dtype=np.float64)
    order = np.argsort(data[:, 0], kind="stable")
    data = data[order]
    return Workload(
        data[:, 0] - data[0, 0], data[:, 1].astype(np.int64), data[:, 2].astype(np.int64)
    )


def _row(rec: dict, where: str) -> tuple[float, int, int]:
    try:
        row = (float(rec["arrival_s"]), int(rec["input_len"]), int(rec["output_len"]))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}: need arrival_s, input_len, output_len ({err})") from None
    if row[1] < 1 or row[2] < 1:
        raise ValueError(f"{where}: lengths must be >= 1")
    return row
