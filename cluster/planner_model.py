"""What the planner reads and says (cluster/planner.py): the controller's observation of the
replicas and their load, each pool's measured capacity, the policy's constants, a pool's
decision; and the queueing approximations its load model rests on."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.config import SLOConfig
from workers.pool import Pool


@dataclass(frozen=True)
class ReplicaState:
    """One replica as the controller sees it. ``age_s`` counts from when it became ready;
    a replica still starting is listed with ``ready=False`` (it counts toward the pool's
    size, so the planner does not ask for it twice)."""

    name: str
    pool: Pool
    age_s: float
    draining: bool = False
    ready: bool = True

    def warming(self, warmup_s: float) -> bool:
        return not self.ready or self.age_s < warmup_s


@dataclass(frozen=True)
class Observation:
    """The router's and actors' metrics over ``[time_s - window_s, time_s]``.

    ``ttft_ms``/``tpot_ms`` are the SLO percentile over the window, excluding requests served
    by warming replicas; None means no samples. ``prefill_queue_time_s`` is the wait of the
    oldest (or mean) queued prompt."""

    time_s: float
    window_s: float
    arrival_rate: float
    mean_input_len: float
    mean_output_len: float
    ttft_ms: float | None
    tpot_ms: float | None
    prefill_queue_tokens: int
    prefill_queue_time_s: float
    decode_waiting: int
    decode_running: int
    replicas: tuple[ReplicaState, ...]
    # Reservations on decode replicas still waiting for their KV, i.e. for a prefill.
    decode_pending: int = 0

    def __post_init__(self) -> None:
        for name in ("window_s", "arrival_rate", "mean_input_len", "mean_output_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if (
            min(
                self.prefill_queue_tokens,
                self.decode_waiting,
                self.decode_running,
                self.decode_pending,
            )
            < 0
        ):
            raise ValueError("queue lengths must be >= 0")


@dataclass(frozen=True)
class PoolCapacity:
    """Per-replica capacity, measured at start-up (or from the simulator's cost model).

    Decode step time model: ``step_s(batch) = decode_step_s_base + decode_step_s_per_seq ·
    batch``; ``decode_max_seqs`` is one decode replica's KV / max_num_seqs limit."""

    prefill_tokens_per_s: float
    decode_step_s_base: float
    decode_step_s_per_seq: float
    decode_max_seqs: int

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_step_s_base <= 0:
            raise ValueError("prefill_tokens_per_s and decode_step_s_base must be positive")
        if self.decode_step_s_per_seq < 0 or self.decode_max_seqs < 1:
            raise ValueError("decode_step_s_per_seq must be >= 0 and decode_max_seqs >= 1")

    def decode_step_s(self, batch: float) -> float:
        return self.decode_step_s_base + self.decode_step_s_per_seq * batch


@dataclass(frozen=True)
class PlannerTuning:
    """The policy's constants (defaults suit most deployments; tests and the simulator may
    override them). Fractions are of the SLO target unless said otherwise."""

    max_utilization: float = 0.85  # never plan a prefill/decode replica busier than this
    decode_headroom: float = 0.9  # plan decode steps at this fraction of the TPOT target
    scale_down_margin: float = 0.8  # N−1 replicas must meet this fraction of the target
    queue_trigger: float = 0.5  # prefill backlog older/longer than this x TTFT → scale now
    correction_alpha: float = 0.3  # EMA weight of a new observed/expected latency ratio
    correction_bounds: tuple[float, float] = (0.5, 3.0)
    min_rate_for_correction: float = 0.05  # req/s; below this a window says nothing
    memory_s: float = 3600.0  # how long "N replicas missed the target at load L" is kept

    def __post_init__(self) -> None:
        for name in ("max_utilization", "decode_headroom", "scale_down_margin", "queue_trigger"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        lo, hi = self.correction_bounds
        if not 0 < lo <= 1 <= hi or not 0 < self.correction_alpha <= 1:
            raise ValueError("correction_bounds must bracket 1 and correction_alpha be in (0, 1]")


@dataclass(frozen=True)
class Decision:
    """One pool's verdict at ``time_s``: hold when ``target == current``. ``needed`` is the
    load model's fractional replica count (for plots)."""

    time_s: float
    pool: Pool
    current: int
    target: int
    reason: str
    needed: float = 0.0

    @property
    def direction(self) -> str:
        return (
            "up" if self.target > self.current else "down" if self.target < self.current else "hold"
        )


def tail_factor(percentile: float) -> float:
    """``k`` in TTFT_p ≈ s·(1 + k·W): the p-quantile of an exponential wait over its mean,
    halved for deterministic-ish service (M/D/c waits are about half of M/M/c's)."""
    return math.log(100.0 / (100.0 - percentile)) / 2.0


def queue_wait_factor(rho: float, replicas: float) -> float:
    """Mean queueing wait over service time of c servers at utilisation ρ (Sakasegawa's
    M/M/c approximation ρ^(√(2(c+1))−1) / (c(1−ρ))): the router balances prompts over the
    pool, so ten replicas at ρ = 0.8 queue far less than one does."""
    if rho >= 1.0:
        return math.inf
    if rho <= 0.0:
        return 0.0
    c = max(replicas, 1.0)
    return rho ** (math.sqrt(2.0 * (c + 1.0)) - 1.0) / (c * (1.0 - rho))


def tail_ttft_s(service_s: float, rho: float, replicas: float, k: float) -> float:
    """Modelled tail TTFT of a prompt needing ``service_s`` alone: ``s·(1 + k·W(ρ, c))``."""
    return service_s * (1.0 + k * queue_wait_factor(rho, replicas))


class LoadModel:
    """One replica's capacity as measured, corrected by what latency was observed (the
    planner's ``correction``), and the pool sizes that meet the SLO under it."""

    def __init__(self, slo: SLOConfig, capacity: PoolCapacity, tuning: PlannerTuning) -> None:
        self.slo = slo
        self.capacity = capacity
        self.tuning = tuning
        # Observed/expected latency ratios (> 1: replicas are slower than measured).
        self.correction = {Pool.PREFILL: 1.0, Pool.DECODE: 1.0}
        self._k = tail_factor(slo.percentile)

    def prefill_rate(self) -> float:
        """Prompt tokens/s of one prefill replica (as measured: sizes the load)."""
        return self.capacity.prefill_tokens_per_s

    def prefill_service_s(self, mean_input_len: float) -> float:
        """What a mean prompt's TTFT costs before queueing, corrected by observation: the
        correction learns what the simple model misses (batching with other prompts,
        overheads, a slower device) from observed/expected TTFT."""
        return max(mean_input_len, 1.0) / self.prefill_rate() * self.correction[Pool.PREFILL]

    def decode_step_s(self, batch: float) -> float:
        return self.capacity.decode_step_s(batch) * self.correction[Pool.DECODE]

    def prefill_target_utilization(self, mean_input_len: float, replicas: int = 1) -> float:
        """The largest utilisation of ``replicas`` at which modelled tail TTFT meets the
        target (0: never, a prompt alone is too slow). Capped at ``max_utilization``."""
        s = self.prefill_service_s(mean_input_len)
        target = self.slo.ttft_ms / 1000.0
        if s >= target:
            return 0.0
        lo, hi = 0.0, self.tuning.max_utilization
        if tail_ttft_s(s, hi, replicas, self._k) <= target:
            return hi
        for _ in range(40):  # bisection: the tail grows with ρ
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if tail_ttft_s(s, mid, replicas, self._k) <= target else (lo, mid)
        return lo

    def prefill_replicas_for(
        self, arrival_rate: float, mean_input_len: float
    ) -> tuple[float, float]:
        """(fractional replicas, their target ρ) to serve the load within the TTFT target:
        the smallest pool size c whose ρ*(c) covers the load, as c·(its ρ)/ρ*(c)."""
        load = arrival_rate * mean_input_len / self.prefill_rate()  # replica-equivalents
        if load <= 0:
            return 0.0, self.prefill_target_utilization(mean_input_len)
        c = max(1, math.ceil(load))
        while True:
            rho = self.prefill_target_utilization(mean_input_len, c)
            if rho <= 0:
                return math.inf, 0.0
            if load <= c * rho or c > 100_000:
                return load / rho, rho
            c += 1

    def predicted_ttft_s(self, replicas: int, rate: float, mean_input_len: float) -> float:
        s = self.prefill_service_s(mean_input_len)
        rho = rate * mean_input_len / (max(replicas, 1e-9) * self.prefill_rate())
        return tail_ttft_s(s, rho, replicas, self._k)

    def decode_batch_limit(self) -> int:
        """The largest per-replica batch whose step meets the TPOT target with headroom."""
        cap = self.capacity
        budget = (
            self.tuning.decode_headroom * self.slo.tpot_ms / 1000.0 / self.correction[Pool.DECODE]
        )
        if budget <= cap.decode_step_s_base:
            return 0
        if cap.decode_step_s_per_seq == 0:
            return cap.decode_max_seqs
        return min(
            cap.decode_max_seqs,
            int((budget - cap.decode_step_s_base) / cap.decode_step_s_per_seq + 1e-9),
        )

    def decode_replicas_for(self, token_rate: float, sequences: float) -> float:
        b = self.decode_batch_limit()
        if b < 1:
            return math.inf
        per_replica = self.tuning.max_utilization * b / self.decode_step_s(b)
        return max(token_rate / per_replica, sequences / b)
