"""The planner as pure policy, on a fake clock: plain floats in ``Observation.time_s``.

A small closed loop (``FakeCluster``) turns decisions into replicas (new ones warm up for
``warmup_s``) and load into observations from the same latency model the planner uses, so
the tests check the policy's dynamics, not the model's accuracy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from cluster.config import PlannerConfig, PoolConfig, SLOConfig
from cluster.planner import Planner
from cluster.planner_metrics import PlannerMetrics
from cluster.planner_model import (
    Decision,
    Observation,
    PlannerTuning,
    PoolCapacity,
    ReplicaState,
    tail_factor,
    tail_ttft_s,
)

SLO = SLOConfig(ttft_ms=1500, tpot_ms=100, percentile=90)
CONFIG = PlannerConfig(enabled=True, interval_s=5, cooldown_s=30, max_step=1, warmup_s=10)
CAPACITY = PoolCapacity(
    prefill_tokens_per_s=4500,
    decode_step_s_base=0.02,
    decode_step_s_per_seq=0.001,
    decode_max_seqs=64,
)
POOLS = {
    "prefill": PoolConfig(min_replicas=1, max_replicas=8, initial_replicas=1),
    "decode": PoolConfig(min_replicas=1, max_replicas=8, initial_replicas=1),
}


def make_planner(**kw) -> Planner:
    args = dict(slo=SLO, config=CONFIG, pools=POOLS, capacity=CAPACITY)
    args.update(kw)
    return Planner(**args)


@dataclass
class FakeCluster:
    """Replicas per pool with ages; latency from the planner's model with the *true*
    capacity scaled by ``slowdown``."""

    planner: Planner
    sizes: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    t: float = 0.0
    ages: dict[str, list[float]] = field(default_factory=dict)
    slowdown: float = 1.0
    queue_tokens: int = 0

    def __post_init__(self) -> None:
        for pool, n in self.sizes.items():
            self.ages.setdefault(pool, [1e9] * n)  # started long ago: warm

    def observe(self, rate: float, in_len=900.0, out_len=100.0, **over) -> Observation:
        p = self.planner
        n_p = len(self.ages["prefill"])
        n_d = len(self.ages["decode"])
        warm_p = sum(a >= CONFIG.warmup_s for a in self.ages["prefill"]) or 1
        s = in_len / (CAPACITY.prefill_tokens_per_s / self.slowdown)
        rho = rate * in_len / (warm_p * CAPACITY.prefill_tokens_per_s / self.slowdown)
        k = tail_factor(SLO.percentile)
        ttft = tail_ttft_s(s, rho, warm_p, k) * 1e3 if rho < 1 else 60_000.0
        running = rate * out_len * 0.05
        tpot = CAPACITY.decode_step_s(running / max(n_d, 1)) * self.slowdown * 1e3
        replicas = tuple(
            ReplicaState(f"{pool}-{i}", pool, age)
            for pool in ("prefill", "decode")
            for i, age in enumerate(self.ages[pool])
        )
        fields = dict(
            time_s=self.t,
            window_s=CONFIG.interval_s,
            arrival_rate=rate,
            mean_input_len=in_len,
            mean_output_len=out_len,
            ttft_ms=ttft if rate > 0 else None,
            tpot_ms=tpot if rate > 0 else None,
            prefill_queue_tokens=self.queue_tokens,
            prefill_queue_time_s=0.0,
            decode_waiting=0,
            decode_running=int(running),
            replicas=replicas,
        )
        fields.update(over)
        del p, n_p
        return Observation(**fields)

    def step(self, rate: float, **kw) -> dict[str, Decision]:
        decisions = {d.pool: d for d in self.planner.decide(self.observe(rate, **kw))}
        for pool, d in decisions.items():
            ages = self.ages[pool]
            if d.target > len(ages):
                ages.extend([0.0] * (d.target - len(ages)))
            elif d.target < len(ages):
                ages.sort(reverse=True)
                del ages[d.target :]
        self.t += CONFIG.interval_s
        for ages in self.ages.values():
            ages[:] = [a + CONFIG.interval_s for a in ages]
        return decisions

    def size(self, pool: str) -> int:
        return len(self.ages[pool])


def needed_prefill(planner: Planner, rate: float, in_len: float = 900.0) -> int:
    return math.ceil(
        rate * in_len / (planner.prefill_rate() * planner.prefill_target_utilization(in_len))
    )


def test_step_up_is_bounded_per_interval_and_reaches_the_need():
    cluster = FakeCluster(make_planner())
    for _ in range(4):
        cluster.step(2.0)
    assert cluster.size("prefill") == 1
    need = needed_prefill(cluster.planner, 12.0)
    assert need >= 3
    sizes = []
    for _ in range(30):
        d = cluster.step(12.0)["prefill"]
        assert d.target - d.current <= CONFIG.max_step
        sizes.append(cluster.size("prefill"))
    assert sizes[-1] == need
    first_up = next(
        d for d in cluster.planner.history if d.pool == "prefill" and d.direction == "up"
    )
    assert "12.00 req/s × 900 tok at 4,500 tok/s/replica" in first_up.reason
    assert "→ +1 (max_step 1)" in first_up.reason


def test_step_down_waits_for_cooldown_and_checks_n_minus_1():
    cluster = FakeCluster(make_planner(), sizes={"prefill": 6, "decode": 1})
    downs = []
    for _ in range(40):
        d = cluster.step(2.0)["prefill"]
        if d.direction == "down":
            downs.append(d)
    assert cluster.size("prefill") == needed_prefill(cluster.planner, 2.0) == 1
    # First removal no sooner than the cooldown after start; then one per cooldown.
    assert downs[0].time_s >= CONFIG.cooldown_s
    gaps = [b.time_s - a.time_s for a, b in zip(downs, downs[1:], strict=False)]
    assert all(g >= CONFIG.cooldown_s for g in gaps)
    assert all(d.current - d.target == 1 for d in downs)
    assert "meet the target with margin" in downs[0].reason


def test_no_scale_down_if_n_minus_1_would_miss_the_target():
    planner = make_planner()
    rate = 4.0
    need = needed_prefill(planner, rate)
    # A load whose need is just under the current size: N−1 would be too few with margin.
    cluster = FakeCluster(planner, sizes={"prefill": need, "decode": 1})
    for _ in range(30):
        d = cluster.step(rate)["prefill"]
        assert d.direction == "hold", d.reason
    assert "would not meet the target" in d.reason or "→ hold" in d.reason


def test_oscillating_load_does_not_flap():
    cluster = FakeCluster(make_planner())
    directions = []
    for i in range(240):  # 20 minutes; load alternates every interval (10 s period)
        rate = 9.0 if i % 2 else 3.0
        directions.append(cluster.step(rate)["prefill"].direction)
    changes = [d for d in directions if d != "hold"]
    # It climbs to what the peaks need and stays: no down at all after that.
    assert "down" not in changes
    assert cluster.size("prefill") == needed_prefill(cluster.planner, 9.0)
    # Slower oscillation (period 4 minutes > cooldown): at most one down per half period.
    cluster = FakeCluster(make_planner())
    sizes = []
    for i in range(288):
        rate = 9.0 if (i // 24) % 2 else 3.0
        cluster.step(rate)
        sizes.append(cluster.size("prefill"))
    # It follows the load (2-minute phases are longer than the cooldown) with one
    # monotonic run of changes per phase: no 2↔1 ping-pong within a phase.
    diffs = [b - a for a, b in zip(sizes, sizes[1:], strict=False) if b != a]
    reversals = sum(1 for a, b in zip(diffs, diffs[1:], strict=False) if a * b < 0)
    assert reversals <= 288 // 24 - 1
    assert max(sizes) == needed_prefill(cluster.planner, 9.0) and min(sizes[30:]) >= 1


def test_burst_scales_on_queue_before_latency_explodes():
    cluster = FakeCluster(make_planner(), sizes={"prefill": 2, "decode": 2})
    for _ in range(10):
        cluster.step(5.0)
    assert cluster.size("prefill") == 2
    # A 3x burst: arrivals now outrun the replicas, the queue grows; the window's TTFT
    # percentile is still fine (the requests that finished arrived before the burst).
    cluster.queue_tokens = 1_000
    d1 = cluster.step(5.0, ttft_ms=400.0)["prefill"]
    cluster.queue_tokens = 12_000
    d2 = cluster.step(15.0, ttft_ms=450.0, prefill_queue_time_s=1.2)["prefill"]
    assert d1.direction == "hold"
    assert d2.direction == "up" and "prefill backlog" in d2.reason
    assert d2.target - d2.current <= CONFIG.max_step


def test_queue_growth_alone_triggers_scale_up():
    planner = make_planner()
    cluster = FakeCluster(planner, sizes={"prefill": 2, "decode": 2})
    for _ in range(8):
        cluster.step(5.0)
    # Below the backlog trigger (0.75 s of work), but growing 600 tok/s (> 5% of capacity).
    cluster.queue_tokens = 3_000
    assert cluster.step(5.0, ttft_ms=300.0)["prefill"].direction == "hold"  # once is noise
    cluster.queue_tokens = 6_000
    d = cluster.step(5.0, ttft_ms=300.0)["prefill"]
    assert d.direction == "up" and "growing" in d.reason


def test_decode_waiting_for_kv_scales_decode():
    cluster = FakeCluster(make_planner(), sizes={"prefill": 1, "decode": 1})
    for _ in range(4):
        cluster.step(1.0)
    d = cluster.step(1.0, decode_waiting=30, decode_running=64)["decode"]
    assert d.direction == "up" and "waiting for decode KV" in d.reason


def test_decode_full_of_reservations_waiting_for_prefill_is_not_a_decode_shortage():
    """A prompt-heavy load: decode's sequence slots are held by reservations whose prompts
    queue at prefill, so requests wait at the router; more decode replicas would not help."""
    cluster = FakeCluster(make_planner(), sizes={"prefill": 1, "decode": 1})
    for _ in range(4):
        cluster.step(1.0)
    d = cluster.step(1.0, decode_waiting=30, decode_running=4, decode_pending=60)["decode"]
    assert d.direction == "hold" and "waiting for decode KV" not in d.reason


def test_warming_replica_samples_do_not_cause_overscaling():
    cluster = FakeCluster(make_planner(), sizes={"prefill": 2, "decode": 1})
    cluster.ages["prefill"][1] = 0.0  # just started
    # Cold-start latency spike in the window: would be +1 if trusted.
    d = cluster.step(1.0, ttft_ms=9000.0)["prefill"]
    assert d.direction == "hold" and "warming" in d.reason
    assert cluster.planner.correction["prefill"] == 1.0  # nothing learnt from that window
    cluster.step(1.0, ttft_ms=9000.0)  # still warming at 5 s
    d = cluster.step(1.0, ttft_ms=9000.0)["prefill"]  # warm now: a real violation
    assert d.direction == "up" and "TTFT p90 9,000 ms > 1,500 ms" in d.reason
    # A starting (not yet ready) replica counts toward the size: not asked for twice.
    planner = make_planner()
    obs = FakeCluster(planner).observe(12.0)
    obs = Observation(
        **{
            **obs.__dict__,
            "replicas": obs.replicas + (ReplicaState("prefill-9", "prefill", 0.0, ready=False),),
        }
    )
    (d_p, _) = planner.decide(obs)
    assert d_p.current == 2 and d_p.target == 3


def test_min_max_bounds():
    cluster = FakeCluster(make_planner())
    for _ in range(40):
        cluster.step(100.0)  # far more than 8 replicas can serve
    assert cluster.size("prefill") == 8 and cluster.size("decode") <= 8
    assert "at max 8" in cluster.planner.history[-2].reason
    for _ in range(200):
        cluster.step(0.0)
    assert cluster.size("prefill") == 1 and cluster.size("decode") == 1
    # Below min: straight to min whatever the load; fixed pools hold.
    pools = {
        "prefill": PoolConfig(min_replicas=2, max_replicas=4, initial_replicas=2),
        "decode": PoolConfig(replicas=3),
    }
    planner = make_planner(pools=pools)
    cluster = FakeCluster(planner, sizes={"prefill": 0, "decode": 3})
    decisions = cluster.step(0.0)
    assert decisions["prefill"].target == 2 and "below min" in decisions["prefill"].reason
    assert decisions["decode"].target == 3 and "fixed size" in decisions["decode"].reason


def test_capacity_correction_from_observed_latency():
    cluster = FakeCluster(make_planner(), sizes={"prefill": 2, "decode": 2}, slowdown=2.0)
    for _ in range(40):
        cluster.step(4.0)
    assert 1.6 < cluster.planner.correction["decode"] <= 2.05
    assert cluster.planner.correction["prefill"] > 1.5
    # With half the measured speed, it needs about twice the prefill replicas.
    assert cluster.size("prefill") >= needed_prefill(make_planner(), 4.0) + 1


def test_decode_sizing_respects_tpot():
    planner = make_planner()
    b = planner.decode_batch_limit()
    assert b == 64 or CAPACITY.decode_step_s(b) <= 0.9 * SLO.tpot_ms / 1e3
    assert CAPACITY.decode_step_s(b + 1) > 0.9 * SLO.tpot_ms / 1e3 or b == 64
    tight = make_planner(slo=SLOConfig(ttft_ms=1500, tpot_ms=30))
    assert tight.decode_batch_limit() == 7  # (0.027 - 0.02) / 0.001


def test_colocated_one_pool_sums_both_phases():
    pools = {"colocated": PoolConfig(min_replicas=1, max_replicas=10)}
    planner = make_planner(pools=pools, colocated=True)
    obs = FakeCluster(make_planner()).observe(6.0)
    replicas = (ReplicaState("colocated-0", "colocated", 100.0),)
    (d,) = planner.decide(Observation(**{**obs.__dict__, "replicas": replicas}))
    assert d.pool == "colocated" and d.direction == "up"
    assert d.needed > needed_prefill(planner, 6.0) - 1
    assert " + need" in d.reason


def test_disabled_planner_holds():
    planner = make_planner(config=PlannerConfig(enabled=False))
    decisions = planner.decide(FakeCluster(planner).observe(50.0))
    assert [d.direction for d in decisions] == ["hold", "hold"]


def test_history_is_bounded_and_metrics_export():
    planner = make_planner()
    cluster = FakeCluster(planner)
    registry = CollectorRegistry()
    metrics = PlannerMetrics(registry)
    for _ in range(5):
        metrics.record(cluster.step(12.0).values(), planner)
    text = generate_latest(registry).decode()
    assert 'pdcluster_planner_target_replicas{pool="prefill"}' in text
    assert 'pdcluster_planner_current_replicas{pool="decode"}' in text
    assert 'pdcluster_planner_decisions_total{direction="up",pool="prefill"}' in text
    assert 'pdcluster_planner_capacity_correction{phase="decode"}' in text
    for _ in range(1100):
        cluster.step(1.0)
    assert len(planner.history) == 2000


def test_invalid_inputs():
    with pytest.raises(ValueError):
        PoolCapacity(0, 0.01, 0.001, 8)
    with pytest.raises(ValueError):
        PlannerTuning(max_utilization=1.5)
    with pytest.raises(ValueError, match="missing decode"):
        Planner(SLO, CONFIG, {"prefill": POOLS["prefill"]}, CAPACITY)


def test_a_size_that_missed_the_target_is_not_returned_to_at_that_load():
    # Heavy-tailed prompts: the model says one replica is enough, experience says not.
    cluster = FakeCluster(make_planner(), sizes={"prefill": 1, "decode": 1})
    for _ in range(3):
        cluster.step(2.0)
    d = cluster.step(2.0, ttft_ms=2500.0)["prefill"]
    assert d.direction == "up"
    for _ in range(60):  # 5 minutes, well past the cooldown, same load
        d = cluster.step(2.0)["prefill"]
        assert d.direction == "hold", d.reason
    assert "1 missed the target" in d.reason
    for _ in range(40):  # at a clearly lower load it may go back
        cluster.step(0.5)
    assert cluster.size("prefill") == 1
