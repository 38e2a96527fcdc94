"""SLO-aware admission's bookkeeping (router/admission.py), on a fake clock."""

from __future__ import annotations

import math

import pytest

from router.admission import (
    HEADROOM,
    DecodeSlotLimit,
    Forecast,
    PrefillSpeed,
    RateMeter,
    SLOTargets,
    TTFTForecast,
)


def feed(limit: DecodeSlotLimit, now: float, tpot_s: float, tokens: int = 20) -> None:
    for i in range(tokens):
        limit.observe(now - i * 0.01, tpot_s, 1)


def test_slo_targets_validate_and_convert():
    slo = SLOTargets(500, 50)
    assert slo.ttft_s == 0.5 and slo.tpot_s == 0.05
    with pytest.raises(ValueError):
        SLOTargets(0, 50)
    with pytest.raises(ValueError):
        SLOTargets(500, -1)


def test_slot_limit_grows_only_while_it_binds_and_tpot_has_headroom():
    limit = DecodeSlotLimit(0.050, initial=8, max_limit=20)
    feed(limit, 1.0, 0.010)
    limit.update(1.0, in_flight=3)  # not binding: no reason to grow
    assert limit.limit == 8
    limit.update(1.0, in_flight=7)  # binding (in_flight >= limit - 1), TPOT 10 ms of 50
    assert limit.limit == 10
    for t in range(2, 10):
        feed(limit, float(t), 0.010)
        limit.update(float(t), in_flight=limit.limit)
    assert limit.limit == 20  # capped at max_limit
    feed(limit, 11.0, 0.035)  # between GROW_BELOW and HEADROOM of the target: hold
    limit.update(11.0, in_flight=20)
    assert limit.limit == 20


def test_slot_limit_cuts_in_proportion_once_per_slow_stretch():
    limit = DecodeSlotLimit(0.050, initial=32)
    feed(limit, 1.0, 0.100)  # twice the target with 32 in flight
    limit.update(1.0, in_flight=32)
    assert limit.limit == int(32 * HEADROOM * 0.050 / 0.100)  # 12
    assert limit.cuts == 1
    limit.update(1.05, in_flight=32)  # the same slow samples are not counted twice
    assert limit.limit == 12 and limit.cuts == 1
    feed(limit, 2.0, 0.041)  # just over HEADROOM x target: cut by at least one
    limit.update(2.0, in_flight=12)
    assert limit.limit == 11
    for t in range(3, 30):
        feed(limit, float(t), 1.0)
        limit.update(float(t), in_flight=limit.limit)
    assert limit.limit == 1  # never zero: the replica always serves someone


def test_slot_limit_ignores_thin_windows_and_old_samples():
    limit = DecodeSlotLimit(0.050, initial=8, window_s=2.0)
    limit.observe(1.0, 0.5, 3)  # 3 tokens: too few to judge
    limit.update(1.0, in_flight=8)
    assert limit.limit == 8
    feed(limit, 1.0, 0.5)
    limit.update(10.0, in_flight=8)  # those samples are older than the window
    assert limit.limit == 8 and limit.mean_tpot_s(10.0) is None
    limit.full_at(5)  # out of KV with 5 in flight: no more than that for now
    assert limit.limit == 5
    limit.full_at(0)
    assert limit.limit == 1


def test_slot_limit_starts_unbounded_and_first_cut_lands_near_what_is_in_use():
    limit = DecodeSlotLimit(0.050, max_limit=1024)
    assert limit.limit == 1024
    feed(limit, 1.0, 0.100)
    limit.update(1.0, in_flight=40)
    assert limit.limit == 16  # 40 x 0.8 x 50 / 100


def test_slot_limit_converges_under_the_target_on_a_linear_step_time_replica():
    """Closed loop against a replica whose step takes 4 ms + 2 ms per sequence, offered far
    more requests than it can serve at a 50 ms TPOT (the best batch is 23)."""
    target = 0.050
    limit = DecodeSlotLimit(target, initial=4, max_limit=64)
    now, tpots = 0.0, []
    while now < 60.0:
        batch = limit.limit  # overloaded: every free slot is taken at once
        step = 0.004 + 0.002 * batch
        for _ in range(int(0.5 / step)):  # half a second of steps between updates
            now += step
            for _ in range(batch):
                limit.observe(now, step, 1)
        limit.update(now, in_flight=batch)
        if now > 20.0:
            tpots.append(0.004 + 0.002 * limit.limit)
    assert max(tpots) <= target
    assert min(tpots) >= 0.6 * HEADROOM * target  # and it does not starve the replica
    assert 10 <= limit.limit <= 23


def test_rate_meter_counts_a_sliding_window():
    meter = RateMeter(window_s=5.0)
    assert meter.rate(0.0) == 0.0
    for t in range(10):
        meter.add(float(t))
    assert meter.rate(9.0) == pytest.approx(6 / 5)  # events at 4..9
    assert meter.rate(100.0) == 0.0
    young = RateMeter(window_s=5.0)
    for i in range(4):
        young.add(10.0 + i * 0.5)  # 4 events in its first 2 seconds: 2/s, not 4/5
    assert young.rate(12.0) == pytest.approx(2.0)
    newborn = RateMeter(window_s=5.0)
    newborn.add(10.0)
    assert newborn.rate(10.2) == pytest.approx(1.0)  # over at least a second


def test_prefill_speed_from_cumulative_counters():
    speed = PrefillSpeed(smoothing=0.5, min_busy_s=0.05)
    assert speed.pool_tokens_per_s(["p0"]) is None
    speed.update("p0", 0, 0.0)
    speed.update("p0", 100, 0.01)  # too little busy time to measure
    assert speed.pool_tokens_per_s(["p0"]) is None
    speed.update("p0", 1000, 1.0)
    assert speed.pool_tokens_per_s(["p0"]) == pytest.approx(1000.0)
    speed.update("p0", 1000 + 3000, 2.0)  # 3000 tok/s now, smoothed halfway
    assert speed.pool_tokens_per_s(["p0"]) == pytest.approx(2000.0)
    speed.update("p0", 10, 0.1)  # counters went back: a restarted actor, start over
    speed.update("p0", 510, 0.6)
    assert speed.pool_tokens_per_s(["p0"]) == pytest.approx(1500.0)
    speed.update("p1", 0, 0.0)
    speed.update("p1", 500, 1.0)
    assert speed.pool_tokens_per_s(["p0", "p1"]) == pytest.approx(2000.0)
    speed.forget("p0")
    assert speed.pool_tokens_per_s(["p0", "p1"]) == pytest.approx(500.0)


def test_ttft_forecast_adds_slot_wait_and_prefill_backlog():
    freed, speed = RateMeter(window_s=1.0), PrefillSpeed()
    forecast = TTFTForecast(freed, speed)
    args = dict(prefill_backlog_tokens=3000, prompt_tokens=1000, prefill_replicas=["p0"])
    # Nothing measured yet: no prefill term, and a wait for KV is not guessed at...
    assert (
        forecast.forecast(10.0, slots_full=False, line_blocked=True, waiting=50, **args).ttft_s
        == 0.0
    )
    # ...nor a few batches of prompts (up to ``cold_tokens``)...
    cold = dict(args, prefill_backlog_tokens=4000, prompt_tokens=96)
    assert (
        forecast.forecast(10.0, slots_full=False, line_blocked=False, waiting=0, **cold).ttft_s == 0
    )
    # ...but a cold start's burst past them is not taken on trust...
    cold["prompt_tokens"] = 97
    burst = forecast.forecast(10.0, slots_full=False, line_blocked=False, waiting=0, **cold)
    assert burst.prefill_s == math.inf
    # ...and with every replica at its slot limit and no slot freed lately, none will be soon.
    assert (
        forecast.forecast(10.0, slots_full=True, line_blocked=False, waiting=0, **args).ttft_s
        == math.inf
    )
    speed.update("p0", 0, 0.0)
    speed.update("p0", 2000, 1.0)  # 2000 prompt tokens per busy second
    for i in range(4):
        freed.add(9.5 + i * 0.1)  # 4 slots freed in the last second
    free = forecast.forecast(10.0, slots_full=False, line_blocked=False, waiting=3, **args)
    assert free.slot_wait_s == 0.0 and free.prefill_s == pytest.approx(2.0)
    full = forecast.forecast(10.0, slots_full=True, line_blocked=False, waiting=7, **args)
    assert full.slot_wait_s == pytest.approx(2.0)  # 8 requests ahead of a slot at 4/s
    assert full.ttft_s == pytest.approx(4.0)
    behind = forecast.forecast(10.0, slots_full=False, line_blocked=True, waiting=7, **args)
    assert behind.slot_wait_s == pytest.approx(2.0)


def test_ttft_forecast_learns_what_its_terms_leave_out_and_fresh_requests_replace_it():
    freed, speed = RateMeter(), PrefillSpeed()
    forecast = TTFTForecast(freed, speed, percentile=90.0, window_s=10.0, min_samples=10)
    args = dict(
        slots_full=False, line_blocked=False, waiting=0, prefill_backlog_tokens=0, prompt_tokens=100
    )
    cold = forecast.forecast(0.0, prefill_replicas=["p0"], **args)
    assert not cold.informed  # no prefill speed yet: its error would teach nothing
    assert forecast.forecast(0.0, prefill_replicas=[], **args).informed  # colocated
    speed.update("p0", 0, 0.0)
    speed.update("p0", 1000, 1.0)
    for _ in range(9):  # too few samples to trust yet
        forecast.observe(1.0, forecast_s=0.1, measured_s=0.3)
    assert forecast.forecast(1.0, prefill_replicas=["p0"], **args).error_s == 0.0
    for i in range(11):  # 20 requests: 18 ran 0.2 s over their forecast, 2 ran 0.9 s over
        forecast.observe(1.0, forecast_s=0.1, measured_s=0.3 if i < 9 else 1.0)
    warm = forecast.forecast(1.0, prefill_replicas=["p0"], **args)
    assert warm.informed and warm.prefill_s == pytest.approx(0.1)
    assert warm.error_s == pytest.approx(0.2)  # the 90th percentile of the misses
    assert warm.ttft_s == pytest.approx(0.3)
    # Out of the window, the latest ``min_samples`` still count: nothing newer is known, and
    # dropping to 0 would admit a burst. (The latest 10: eight 0.2 s misses, two 0.9 s.)
    assert forecast.forecast(12.0, prefill_replicas=["p0"], **args).error_s == pytest.approx(0.9)
    for _ in range(10):  # fresh requests (probes) replace them
        forecast.observe(12.5, forecast_s=0.1, measured_s=0.15)
    assert forecast.error_s(12.5) == pytest.approx(0.05)
    early = Forecast(slot_wait_s=0.0, prefill_s=0.1, error_s=-0.5)
    assert early.ttft_s == 0.0  # a forecast that overshot never goes below zero
