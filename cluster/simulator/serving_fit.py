"""Fitting :class:`~cluster.simulator.serving.ServingOverheads` to a measured low-load
`pdcluster bench serve` run, and replaying measured runs through the simulator.

The fit never sees the run it is judged on: fit on a low-load run (few requests overlap,
so what is left after the engine's own time is the serving path), then replay a run at a
higher rate with the fitted terms and compare percentiles.

1. From the probe (:class:`ServeProbe`, snapshots of ``benchmarks/serve_probe.py``): the
   cores, the background's idle core-seconds per second and CPU seconds per delivered
   token; and ``prefill_factor`` = the prefill actor's time in steps ÷ the cost model's
   time for the run's prompts (at low load each step is one prompt).
   Without a probe: no CPU sharing, and ``prefill_factor`` from step 2's regression.
2. TTFT: replay the run; ``request_s`` = mean(measured − simulated TTFT), request by
   request (same arrivals, same prompts). Without a probe, regress instead
   ``measured ≈ request_s + k · simulated`` and set ``prefill_factor *= k``. Three rounds
   (the queueing the terms cause moves the simulated side).
3. TPOT: bisect ``decode_factor`` until the replay's TPOT median matches the measured one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from cluster.simulator.cluster_model import SimConfig
from cluster.simulator.result import SimResult
from cluster.simulator.serving import ServingOverheads
from cluster.simulator.simulation import simulate
from cluster.simulator.workload import Workload


@dataclass(frozen=True)
class ServeRun:
    """What a `pdcluster bench serve` run offered (arrivals, prompt and answer lengths of
    its completed requests) and what its client measured for each (seconds)."""

    rate: float
    workload: Workload
    ttft_s: np.ndarray
    tpot_s: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.workload)
        if n == 0:
            raise ValueError("a serve run needs at least one completed request")
        if len(self.ttft_s) != n or len(self.tpot_s) != n:
            raise ValueError("one TTFT and one TPOT per request")

    @classmethod
    def from_bench_json(cls, data: dict) -> ServeRun:
        """From ``pdcluster bench serve --json-out`` (or its trimmed copy: the same keys)."""
        reqs = sorted(
            (r for r in data["requests"] if r.get("ok") and r.get("ttft_s") is not None),
            key=lambda r: r["start_s"],
        )
        if not reqs:
            raise ValueError("the run has no completed request")
        workload = Workload(
            np.array([r["start_s"] for r in reqs], dtype=float),
            np.array([r["input_len"] for r in reqs], dtype=np.int64),
            np.array([r.get("num_tokens") or r["output_len"] for r in reqs], dtype=np.int64),
        )
        return cls(
            float(data["config"]["rate"]),
            workload,
            np.array([r["ttft_s"] for r in reqs], dtype=float),
            np.array([r["tpot_s"] if r["tpot_s"] is not None else np.nan for r in reqs]),
        )

    def percentile(self, which: str, p: float) -> float:
        values = getattr(self, f"{which}_s")
        return float(np.percentile(values[~np.isnan(values)], p))


@dataclass(frozen=True)
class ServeProbe:
    """What probe snapshots of the served run tell beyond its client's latencies.

    ``background_cpu_s``: core-seconds per second used with no traffic (router polls, Ray);
    ``cpu_per_token_s``: CPU seconds per delivered output token under load beyond that
    idle use and beyond the engine steps (router, poll calls, the load generator);
    ``prefill_busy_s``: seconds the prefill actors spent in engine steps during the run
    (None: not reported)."""

    cores: float
    background_cpu_s: float
    cpu_per_token_s: float
    prefill_busy_s: float | None = None

    def __post_init__(self) -> None:
        if self.cores <= 0 or self.background_cpu_s < 0 or self.cpu_per_token_s < 0:
            raise ValueError("cores must be > 0, CPU uses >= 0")
        if self.prefill_busy_s is not None and self.prefill_busy_s <= 0:
            raise ValueError("prefill_busy_s must be positive")

    @classmethod
    def from_snapshots(
        cls,
        idle: dict,
        before: dict,
        after: dict,
        client_cpu_s: float,
        tokens: int,
        cores: float,
    ) -> ServeProbe:
        """``idle`` → ``before``: a window without traffic; ``before`` → ``after``: the run
        (snapshots of ``benchmarks.serve_probe``). ``client_cpu_s``: the load generator's
        CPU seconds; ``tokens``: output tokens it received. The engine loops' own time is
        not background: the workers' CPU counts only beyond their steps' ``busy_s`` where
        every worker reports it, and not at all where one does not."""
        if tokens <= 0:
            raise ValueError("tokens must be positive")
        idle_wall = before["wall_s"] - idle["wall_s"]
        run_wall = after["wall_s"] - before["wall_s"]
        if idle_wall <= 0 or run_wall <= 0:
            raise ValueError("snapshots must be in time order")
        background = max((_outside_steps(before) - _outside_steps(idle)) / idle_wall, 0.0)
        run_cpu = _outside_steps(after) - _outside_steps(before)
        per_token = (run_cpu - background * run_wall + client_cpu_s) / tokens
        prefill = [
            (after["actors"][name].get("busy_s"), actor.get("busy_s"))
            for name, actor in before["actors"].items()
            if name.startswith("prefill") and name in after["actors"]
        ]
        busy = None
        if prefill and all(a is not None and b is not None for a, b in prefill):
            busy = sum(a - b for a, b in prefill) or None
        return cls(float(cores), float(background), float(max(per_token, 0.0)), busy)


def foreign_load(before: dict, after: dict, client_cpu_s: float) -> float | None:
    """Cores that other jobs on the machine used during the run (its busy CPU seconds less
    the server's and the load generator's, per second), or None if the snapshots lack the
    machine's total. Not a fitted term: a measured condition of that run, which a replay may
    add to ``background_cpu_s``."""
    if "host_cpu_s" not in before or "host_cpu_s" not in after:
        return None
    wall = after["wall_s"] - before["wall_s"]
    if wall <= 0:
        raise ValueError("snapshots must be in time order")
    server = sum(after["cpu_s"].values()) - sum(before["cpu_s"].values())
    host = after["host_cpu_s"] - before["host_cpu_s"]
    return max((host - server - client_cpu_s) / wall, 0.0)


WORKER_GROUPS = ("decode", "prefill", "colocated")  # benchmarks.serve_probe's group names


def _outside_steps(snapshot: dict) -> float:
    """CPU seconds of the serving processes so far, less the engine steps'."""
    cpu = snapshot["cpu_s"]
    busy = [a.get("busy_s") for a in snapshot["actors"].values()]
    if busy and all(b is not None for b in busy):
        return float(sum(cpu.values()) - sum(busy))
    return float(sum(v for g, v in cpu.items() if g not in WORKER_GROUPS))


def replay(config: SimConfig, run: ServeRun) -> SimResult:
    """The simulator on ``run``'s exact arrivals and lengths."""
    return simulate(config, run.workload)


def fit_serving(config: SimConfig, run: ServeRun, probe: ServeProbe | None) -> ServingOverheads:
    """Serving overheads that make ``config`` (the bare engine's cost model and the served
    layout) reproduce the low-load ``run`` (steps in the module docstring). ``probe`` None:
    the pools are not modelled as sharing cores."""
    o = ServingOverheads()
    if probe is not None:
        o = ServingOverheads(
            cores=probe.cores,
            background_cpu_s=probe.background_cpu_s,
            cpu_per_token_s=probe.cpu_per_token_s,
        )
    measured_prefill = probe is not None and probe.prefill_busy_s is not None
    if measured_prefill:
        cost = config.cost
        engine_s = sum(cost.prefill_time(int(n), float(n) ** 2, 1) for n in run.workload.input_len)
        o = replace(o, prefill_factor=probe.prefill_busy_s / engine_s)
    for _ in range(3):
        sim = replay(replace(config, serving=o), run)
        without = sim.ttft_s - o.request_s
        if measured_prefill:
            ok = ~np.isnan(without)
            o = replace(o, request_s=max(float(np.mean(run.ttft_s[ok] - without[ok])), 0.0))
        else:
            k, intercept = _line(without, run.ttft_s)
            o = replace(o, prefill_factor=o.prefill_factor * k, request_s=intercept)
    o = replace(o, decode_factor=_bisect_decode_factor(config, run, o))
    return o


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares y ≈ intercept + k·x with k > 0 and intercept >= 0 (through the
    origin when the free intercept would be negative)."""
    ok = ~(np.isnan(x) | np.isnan(y))
    x, y = x[ok], y[ok]
    k, intercept = np.polyfit(x, y, 1) if len(set(x.tolist())) > 1 else (0.0, 0.0)
    if intercept < 0 or k <= 0:
        k, intercept = float(np.dot(x, y) / np.dot(x, x)), 0.0
    return float(max(k, 1e-3)), float(intercept)


def _bisect_decode_factor(config: SimConfig, run: ServeRun, o: ServingOverheads) -> float:
    target = run.percentile("tpot", 50)

    def tpot(factor: float) -> float:
        sim = replay(replace(config, serving=replace(o, decode_factor=factor)), run)
        return sim.percentile("tpot", 50)

    lo, hi = 0.1, 1.0
    while tpot(hi) < target and hi < 1e3:
        lo, hi = hi, hi * 2
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tpot(mid) < target else (lo, mid)
    return (lo + hi) / 2
