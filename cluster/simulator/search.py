"""``pdcluster plan``: the cheapest prefill/decode split meeting the SLOs, next to colocation.

Method (DistServe's, on our simulator):

1. Per-replica goodput of each phase alone: the highest Poisson rate one prefill replica
   serves with TTFT attainment ≥ target (decode pool ample), and the same for one decode
   replica and TPOT. Binary search on rate, each probe a simulation with the same random
   numbers (common seeds), so attainment is monotone in practice.
2. A first guess at the target rate R: ``⌈R / goodput⌉`` replicas per pool; then simulate
   at R and walk: add a replica to the phase that misses, remove one while both still meet
   (pooling several replicas absorbs bursts better than one, so the guess is pessimistic).
3. The same for colocated replicas (both phases share a replica; prefill stalls decode).
4. Goodput per GPU of a configuration: the highest rate it serves at the target
   attainment, divided by its GPUs.

Parallelism per phase (DistServe's other half): with ``tp_choices``, each pool's tensor
parallel degree is the one that meets its phase's target at the rate on the fewest GPUs
(steps 1-2 for that pool alone, at every candidate degree), chosen for prefill, decode and
colocated replicas separately.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cluster.config import PoolConfig, SLOConfig
from cluster.simulator.cluster_model import SimConfig
from cluster.simulator.cost_model import CostModel
from cluster.simulator.result import SimResult
from cluster.simulator.simulation import simulate
from cluster.simulator.workload import Workload, poisson
from workers.pool import Pool


@dataclass(frozen=True)
class PlanSpec:
    cost: CostModel
    slo: SLOConfig
    input_len: str
    output_len: str
    attainment: float = 0.9  # fraction of requests meeting both SLOs
    requests: int = 2000  # per probe (the same count at every rate: constant cost)
    max_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_replicas: int = 128  # per pool, bounds the search
    seed: int = 0
    prefill_tp: int | None = None  # None: the cost model's tp
    decode_tp: int | None = None
    colocated_tp: int | None = None
    tp_choices: tuple[int, ...] = ()  # non-empty: search each pool's tp among these

    def workload(self, rate: float) -> Workload:
        return poisson(rate, self.requests / rate, self.input_len, self.output_len, self.seed)

    def config(self, prefill: int = 1, decode: int = 1, colocated: int = 0) -> SimConfig:
        mode = "colocated" if colocated else "disaggregated"
        cost = self.cost
        if colocated and self.colocated_tp:
            cost = replace(cost, tp=self.colocated_tp)
        return SimConfig(
            cost=cost,
            slo=self.slo,
            mode=mode,
            prefill=PoolConfig(replicas=max(prefill, 1)),
            decode=PoolConfig(replicas=max(decode, 1)),
            colocated=PoolConfig(replicas=max(colocated, 1)),
            max_batched_tokens=self.max_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            seed=self.seed,
            prefill_tp=None if colocated else self.prefill_tp,
            decode_tp=None if colocated else self.decode_tp,
        )


@dataclass(frozen=True)
class Deployment:
    """A configuration and how it does at the target rate."""

    mode: str
    prefill: int
    decode: int
    colocated: int
    gpus: int
    rate: float
    result: SimResult
    max_goodput: float  # req/s at the target attainment
    prefill_tp: int = 1
    decode_tp: int = 1
    colocated_tp: int = 1

    @property
    def goodput_per_gpu(self) -> float:
        return self.max_goodput / self.gpus

    def describe(self) -> str:
        if self.mode == "colocated":
            shape = f"{self.colocated} colocated (tp {self.colocated_tp})"
        else:
            shape = (
                f"{self.prefill} prefill (tp {self.prefill_tp}) + {self.decode} decode "
                f"(tp {self.decode_tp})"
            )
        s = self.result.summary()
        p = self.result.config.slo.percentile
        return (
            f"{shape} replicas = {self.gpus} GPUs; at {self.rate:g} req/s: attainment "
            f"{s['attainment']:.1%}, TTFT p{p:g} {s[f'ttft_p{p:g}_ms']:.0f} ms, TPOT p{p:g} "
            f"{s[f'tpot_p{p:g}_ms']:.1f} ms; max goodput {self.max_goodput:.2f} req/s = "
            f"{self.goodput_per_gpu:.3f} req/s/GPU"
        )


def _phase_attainment(result: SimResult, phase: str) -> float:
    slo = result.config.slo
    if phase == "ttft":
        return float((result.ttft_s * 1e3 <= slo.ttft_ms).mean())
    tpot = result.tpot_s
    return float(((tpot * 1e3 <= slo.tpot_ms) & ~(tpot != tpot)).mean())


def max_rate(
    spec: PlanSpec, config: SimConfig, phase: str = "both", hi: float | None = None
) -> float:
    """The highest rate ``config`` serves with ``phase`` attainment ≥ target (±1%)."""

    def ok(rate: float) -> bool:
        return _meets(spec, config, rate, phase)

    lo, hi = 0.0, hi or _rough_rate(spec, config)
    while ok(hi):  # grow until it fails
        lo, hi = hi, hi * 2
        if hi > 1e7:
            return hi
    while hi - lo > 0.01 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _rough_rate(spec: PlanSpec, config: SimConfig) -> float:
    """A starting rate from the cost model: one replica's throughput of its bottleneck."""
    cap = config.planner_capacity(_mean(spec.input_len), _mean(spec.output_len))
    prefill = cap.prefill_tokens_per_s / _mean(spec.input_len)
    b = cap.decode_max_seqs
    decode = b / cap.decode_step_s(b) / _mean(spec.output_len)
    n = sum(p.initial for p in config.pools.values())
    return max(0.05, 0.5 * n * min(prefill, decode))


def _mean(spec: str) -> float:
    import numpy as np

    from cluster.simulator.workload import parse_length

    return float(np.mean(parse_length(spec)(np.random.default_rng(0), 4000)))


def _evaluate(spec: PlanSpec, rate: float, p: int, d: int, c: int) -> SimResult:
    return simulate(spec.config(p, d, c), spec.workload(rate))


def tp_options(cost: CostModel, largest: int) -> tuple[int, ...]:
    """Degrees a replica can take: powers of two up to ``largest`` (a node's GPUs) that
    split the heads (KV heads split or replicated evenly) and leave KV room after weights."""
    m = cost.model
    options = []
    tp = 1
    while tp <= largest:
        splits = m.num_heads % tp == 0 and (
            m.num_kv_heads % tp == 0 if tp <= m.num_kv_heads else tp % m.num_kv_heads == 0
        )
        if splits:
            try:
                replace(cost, tp=tp).kv_capacity_tokens()
                options.append(tp)
            except ValueError:
                pass  # the weights do not fit
        tp *= 2
    return tuple(options)


def _best_tp(spec: PlanSpec, field: str, rate: float, phase: str) -> int:
    """The degree of ``field``'s pool that meets ``phase``'s target at ``rate`` on the
    fewest GPUs (the other pool ample; ties go to the smaller degree). Sized at the rate,
    not by one replica's goodput: one small replica queues more than several pooled."""
    big = spec.max_replicas
    best, best_gpus = None, math.inf
    for tp in sorted(spec.tp_choices):
        trial = replace(spec, **{field: tp})
        sized = {
            "prefill_tp": lambda n, t=trial: t.config(n, big),
            "decode_tp": lambda n, t=trial: t.config(big, n),
            "colocated_tp": lambda n, t=trial: t.config(colocated=n),
        }[field]
        one = max_rate(trial, sized(1), phase)
        n = min(big, max(1, math.ceil(rate / max(one, 1e-9))))
        while n > 1 and _meets(trial, sized(n - 1), rate, phase):
            n -= 1
        while n < big and not _meets(trial, sized(n), rate, phase):
            n += 1
        if n * tp < best_gpus:
            best, best_gpus = tp, n * tp
    assert best is not None
    return best


def _meets(spec: PlanSpec, config: SimConfig, rate: float, phase: str) -> bool:
    result = simulate(config, spec.workload(rate))
    value = result.attainment() if phase == "both" else _phase_attainment(result, phase)
    return value >= spec.attainment


def plan_disaggregated(spec: PlanSpec, rate: float) -> Deployment:
    big = spec.max_replicas
    if spec.tp_choices:
        least = min(spec.tp_choices)  # the other pool's degree while one pool's is searched
        spec = replace(spec, prefill_tp=spec.prefill_tp or least, decode_tp=spec.decode_tp or least)
        spec = replace(
            spec,
            prefill_tp=_best_tp(spec, "prefill_tp", rate, "ttft"),
            decode_tp=_best_tp(spec, "decode_tp", rate, "tpot"),
        )
    per_p = max_rate(spec, spec.config(1, big), "ttft")
    per_d = max_rate(spec, spec.config(big, 1), "tpot")
    p = min(big, max(1, math.ceil(rate / per_p)))
    d = min(big, max(1, math.ceil(rate / per_d)))
    result = _evaluate(spec, rate, p, d, 0)
    for _ in range(2 * big):  # grow until it meets
        if result.attainment() >= spec.attainment or (p >= big and d >= big):
            break
        if _phase_attainment(result, "ttft") <= _phase_attainment(result, "tpot") and p < big:
            p += 1
        else:
            d += 1
        result = _evaluate(spec, rate, p, d, 0)
    for _ in range(2 * big):  # shrink while it still meets
        trial = None
        for dp, dd in ((1, 0), (0, 1)) if p >= d else ((0, 1), (1, 0)):
            if p - dp >= 1 and d - dd >= 1:
                r = _evaluate(spec, rate, p - dp, d - dd, 0)
                if r.attainment() >= spec.attainment:
                    trial = (p - dp, d - dd, r)
                    break
        if trial is None:
            break
        p, d, result = trial
    config = spec.config(p, d)
    goodput = max_rate(spec, config, hi=max(rate, 0.05))
    tp_p, tp_d = config.tp(Pool.PREFILL), config.tp(Pool.DECODE)
    gpus = p * tp_p + d * tp_d
    return Deployment(
        "disaggregated", p, d, 0, gpus, rate, result, goodput, prefill_tp=tp_p, decode_tp=tp_d
    )


def plan_colocated(spec: PlanSpec, rate: float) -> Deployment:
    big = spec.max_replicas
    if spec.tp_choices:
        best = _best_tp(spec, "colocated_tp", rate, "both")
        spec = replace(spec, colocated_tp=best)
    per_c = max_rate(spec, spec.config(colocated=1))
    c = min(big, max(1, math.ceil(rate / max(per_c, 1e-9))))
    result = _evaluate(spec, rate, 0, 0, c)
    while result.attainment() < spec.attainment and c < big:
        c += 1
        result = _evaluate(spec, rate, 0, 0, c)
    while c > 1:
        r = _evaluate(spec, rate, 0, 0, c - 1)
        if r.attainment() < spec.attainment:
            break
        c, result = c - 1, r
    config = spec.config(colocated=c)
    goodput = max_rate(spec, config, hi=max(rate, 0.05))
    tp = config.cost.tp
    return Deployment("colocated", 0, 0, c, c * tp, rate, result, goodput, colocated_tp=tp)


def plan(spec: PlanSpec, rate: float) -> tuple[Deployment, Deployment]:
    """(disaggregated, colocated): each the cheapest meeting the target at ``rate``."""
    return plan_disaggregated(spec, rate), plan_colocated(spec, rate)


def attainment_curve(spec: PlanSpec, deployment: Deployment, rates: list[float]) -> list[float]:
    spec = replace(
        spec,
        prefill_tp=deployment.prefill_tp,
        decode_tp=deployment.decode_tp,
        colocated_tp=deployment.colocated_tp,
    )
    config = spec.config(deployment.prefill, deployment.decode, deployment.colocated)
    return [simulate(config, spec.workload(r)).attainment() for r in rates]


def with_workload_lengths(spec: PlanSpec, input_len: str, output_len: str) -> PlanSpec:
    return replace(spec, input_len=input_len, output_len=output_len)
