"""SLO-aware admission's bookkeeping (router/admission.py), on a fake clock."""

from __future__ import annotations

import math

import pytest

from engine.step_cost import StepCost
from router.admission import (
    HEADROOM,
    DecodeSlotLimit,
    Forecast,
    LineTurnTime,
    RateMeter,
    ReplicaCapacity,
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


def test_slot_limit_near_the_tpot_budget_stops_the_load_climbing():
    limit = DecodeSlotLimit(0.050, max_limit=1024)
    feed(limit, 1.0, 0.035)  # between GROW_BELOW and HEADROOM x target, 30 in flight
    limit.update(1.0, in_flight=30)
    assert limit.limit == 31 and limit.cuts == 0  # no longer unlimited: held near 30
    feed(limit, 2.0, 0.020)  # room again: grows while it binds
    limit.update(2.0, in_flight=31)
    assert limit.limit == 38


def test_slot_limit_near_the_budget_at_light_load_holds_the_free_batch():
    """One request in flight, its steps near the budget (a colocated replica's prefills
    between them): held at the free batch, not at 1 + 1, so a second arrival is not
    made to wait for the first to finish."""
    limit = DecodeSlotLimit(0.200)
    feed(limit, 1.0, 0.130)  # between GROW_BELOW and HEADROOM x target
    limit.update(1.0, in_flight=0, floor=3)
    assert limit.limit == 3 and limit.cuts == 0
    limit.update(1.0, in_flight=5, floor=3)
    assert limit.limit == 3  # holds: it comes down, never up, in this band


def test_slot_limit_waits_for_a_cut_to_take_effect_before_cutting_again():
    limit = DecodeSlotLimit(0.050, max_limit=1024)
    feed(limit, 1.0, 0.100)
    limit.update(1.0, in_flight=40)
    assert limit.limit == 16
    # Steps stay slow until requests finish and the batch shrinks to the limit: no new cut
    # on them (it would leave the requests waiting for a slot stranded for seconds).
    for t, in_flight in ((1.5, 35), (2.0, 27), (2.5, 17)):
        feed(limit, t, 0.100)
        limit.update(t, in_flight=in_flight)
    assert limit.limit == 16 and limit.cuts == 1
    feed(limit, 3.0, 0.045)  # at the limit now, and still over HEADROOM x target
    limit.update(3.0, in_flight=16)
    assert limit.limit == 14 and limit.cuts == 2


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


def test_head_of_line_time_is_a_recent_mean_and_at_least_the_current_heads_wait():
    head = LineTurnTime(window_s=5.0, min_samples=2)
    assert head.mean_s(0.0) == 0.0  # nothing seen
    assert head.mean_s(0.0, current_turn_s=0.3) == 0.3  # a head already stuck that long
    for t in range(10):
        head.departed(float(t), 0.1 if t < 6 else 0.5)
    assert head.mean_s(9.0) == pytest.approx((2 * 0.1 + 4 * 0.5) / 6)  # departures at 4..9
    assert head.mean_s(9.0, current_turn_s=2.0) == 2.0  # the current head waits longer
    # Long after, the latest ``min_samples`` still count: nothing newer is known.
    assert head.mean_s(100.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        LineTurnTime(window_s=0)


def cost(tokens_per_s: float, base_s: float = 0.05, per_seq_s: float = 0.0, steps: int = 0):
    return StepCost(base_s, per_seq_s, 1.0 / tokens_per_s, decode_steps=steps, prompt_tokens=1000)


def test_replica_capacity_from_the_workers_step_costs():
    capacity = ReplicaCapacity()
    assert capacity.pool_tokens_per_s(["p0"]) is None and capacity.free_batch("d0") == 1
    capacity.update("p0", None)  # nothing measured yet: nothing known
    assert capacity.pool_tokens_per_s(["p0"]) is None
    capacity.update("p0", cost(1000.0))
    capacity.update("p1", cost(500.0))
    assert capacity.pool_tokens_per_s(["p0", "p1"]) == pytest.approx(1500.0)
    capacity.forget("p0")
    assert capacity.pool_tokens_per_s(["p0", "p1"]) == pytest.approx(500.0)
    # A decode replica whose steps cost 100 ms + 2 ms per sequence: 13 cost <= 1.25 x one.
    capacity.update("d0", cost(1000.0, base_s=0.1, per_seq_s=0.002, steps=50))
    assert capacity.free_batch("d0") == 13


def test_ttft_forecast_adds_the_wait_in_line_and_the_prefill_backlog():
    head, freed, capacity = LineTurnTime(), RateMeter(window_s=1.0), ReplicaCapacity()
    forecast = TTFTForecast(head, freed, capacity)
    args = dict(prefill_backlog_tokens=3000, prompt_tokens=1000, prefill_replicas=["p0"])
    # Nothing measured yet: no wait in line and no prefill term...
    assert (
        forecast.forecast(10.0, waiting=50, current_turn_s=0.0, free_slots=math.inf, **args).ttft_s
        == 0.0
    )
    # ...nor for a few batches of prompts (up to ``cold_tokens``)...
    cold = dict(args, prefill_backlog_tokens=4000, prompt_tokens=96)
    assert (
        forecast.forecast(10.0, waiting=0, current_turn_s=0.0, free_slots=math.inf, **cold).ttft_s
        == 0
    )
    # ...but a cold start's burst past them is not taken on trust...
    cold["prompt_tokens"] = 97
    burst = forecast.forecast(10.0, waiting=0, current_turn_s=0.0, free_slots=math.inf, **cold)
    assert burst.prefill_s == math.inf
    # ...and a head already stuck at the line says how long each one ahead may take.
    stuck = forecast.forecast(10.0, waiting=4, current_turn_s=0.5, free_slots=math.inf, **args)
    assert stuck.slot_wait_s == pytest.approx(2.5)
    capacity.update("p0", cost(2000.0))  # 2000 prompt tokens per second
    for i in range(4):
        head.departed(9.5 + i * 0.1, 0.25)  # each request spent 0.25 s at the head
    alone = forecast.forecast(10.0, waiting=0, current_turn_s=0.0, free_slots=math.inf, **args)
    assert alone.slot_wait_s == pytest.approx(0.25) and alone.prefill_s == pytest.approx(2.0)
    behind = forecast.forecast(10.0, waiting=7, current_turn_s=0.1, free_slots=math.inf, **args)
    assert behind.slot_wait_s == pytest.approx(2.0)  # 8 turns at the head of 0.25 s
    assert behind.ttft_s == pytest.approx(4.0) and behind.raw_s == pytest.approx(4.0)
    # With every replica at its slot limit, a turn lasts at least until a slot frees: 4
    # freed in the last second, so 0.25 s each...
    for i in range(4):
        freed.add(9.1 + i * 0.25)
    full = forecast.forecast(10.0, waiting=7, current_turn_s=0.0, free_slots=0, **args)
    assert full.slot_wait_s == pytest.approx(2.0)
    head.departed(10.0, 0.05)
    head.departed(10.0, 0.05)  # (however fast recent turns were)
    assert forecast.forecast(
        10.0, waiting=7, current_turn_s=0.0, free_slots=0, **args
    ).slot_wait_s == pytest.approx(2.0)
    # ...and with none freed lately, none will be soon.
    none_freed = forecast.forecast(20.0, waiting=0, current_turn_s=0.0, free_slots=0, **args)
    assert none_freed.slot_wait_s == math.inf


def test_ttft_forecast_gives_the_free_slots_to_the_first_in_line_and_the_rest_wait_for_more():
    head, freed = LineTurnTime(), RateMeter(window_s=2.0)
    forecast = TTFTForecast(head, freed, ReplicaCapacity())
    head.departed(9.0, 0.1)  # a turn at the head takes 0.1 s while slots are free
    for i in range(4):
        freed.add(8.0 + i * 0.5)  # 2 slots freed per second
    args = dict(current_turn_s=0.0, prefill_backlog_tokens=0, prompt_tokens=10)
    args["prefill_replicas"] = []
    ahead_fits = forecast.forecast(10.0, waiting=2, free_slots=3, **args)
    assert ahead_fits.slot_wait_s == pytest.approx(0.3)  # 3 turns, all with a free slot
    # 7 ahead and 3 free slots: 3 quick turns, then 5 that each wait for a slot to free.
    behind = forecast.forecast(10.0, waiting=7, free_slots=3, **args)
    assert behind.slot_wait_s == pytest.approx(3 * 0.1 + 5 * 0.5)
    # A request of 4 sequences (n=4) with 2 ahead needs 6 slots: 3 free, 3 to wait for.
    wide = forecast.forecast(10.0, waiting=2, free_slots=3, slots_needed=4, **args)
    assert wide.slot_wait_s == pytest.approx(0 * 0.1 + 3 * 0.5)


def test_ttft_forecast_waits_for_the_running_requests_expected_ends():
    head, freed = LineTurnTime(), RateMeter(window_s=5.0)
    forecast = TTFTForecast(head, freed, ReplicaCapacity())
    head.departed(9.0, 0.1)
    args = dict(current_turn_s=0.0, prefill_backlog_tokens=0, prompt_tokens=10)
    args["prefill_replicas"] = []
    # Light load: no slot freed in the window, so the rate alone says "never"...
    assert forecast.forecast(10.0, waiting=0, free_slots=0, **args).slot_wait_s == math.inf
    # ...but the running requests say when they end: the first slot frees in 1.2 s.
    ends = [1.2, 3.0]
    soon = forecast.forecast(10.0, waiting=0, free_slots=0, slot_ends_s=ends, **args)
    assert soon.slot_wait_s == pytest.approx(1.2)
    second = forecast.forecast(10.0, waiting=1, free_slots=0, slot_ends_s=ends, **args)
    assert second.slot_wait_s == pytest.approx(3.0)
    # Past the known ends, turns go at the rate slots freed lately (2 in 4 s here).
    freed.add(6.0)
    freed.add(8.5)
    third = forecast.forecast(10.0, waiting=2, free_slots=0, slot_ends_s=ends, **args)
    assert third.slot_wait_s == pytest.approx(3.0 + 2.0)


def test_decode_progress_expects_each_request_to_end_at_its_own_pace():
    from router.decode_progress import DecodeProgress

    progress = DecodeProgress()
    progress.start("a", "d0", max_tokens=10)
    progress.start("b", "d0", max_tokens=4)
    progress.start("c", "d1", max_tokens=2)
    assert progress.slot_ends_s({"d0"}, 0.0) == []  # no pace yet (prefilling)
    progress.delivered("a", 1.0, 1)
    progress.delivered("a", 1.5, 1)  # 0.5 s per token, 8 left → 4 s after its last token
    progress.delivered("b", 1.0, 1)
    progress.delivered("b", 1.2, 2)  # 0.1 s per token, 1 left
    assert progress.slot_ends_s({"d0"}, 1.5) == pytest.approx([0.0, 4.0])
    progress.end("b")
    assert progress.slot_ends_s({"d0", "d1"}, 2.0) == pytest.approx([3.5])


def test_ttft_forecast_learns_what_its_terms_leave_out_and_fresh_requests_replace_it():
    head, capacity = LineTurnTime(), ReplicaCapacity()
    forecast = TTFTForecast(
        head, RateMeter(), capacity, percentile=90.0, window_s=10.0, min_samples=10
    )
    args = dict(
        waiting=0,
        current_turn_s=0.0,
        free_slots=math.inf,
        prefill_backlog_tokens=0,
        prompt_tokens=100,
    )
    cold = forecast.forecast(0.0, prefill_replicas=["p0"], **args)
    assert not cold.informed  # no prefill speed yet: its error would teach nothing
    assert forecast.forecast(0.0, prefill_replicas=[], **args).informed  # colocated
    capacity.update("p0", cost(1000.0))
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


def test_ttft_forecast_learns_from_requests_still_late_for_their_first_token():
    forecast = TTFTForecast(
        LineTurnTime(), RateMeter(), ReplicaCapacity(), percentile=90.0, min_samples=10
    )
    assert forecast.error_s(0.0) == 0.0
    forecast.admitted("a", arrival=0.0, forecast_s=0.5)
    forecast.admitted("b", arrival=0.0, forecast_s=2.0)
    # Before any first token: a pending request past its forecast is hard evidence.
    assert forecast.error_s(1.0) == pytest.approx(0.5)  # "a" is 0.5 s late; "b" is not due
    forecast.first_token("a", now=1.2)
    assert forecast.error_s(1.2) == 0.0  # one error: too few to trust, and none late now
    for _ in range(9):
        forecast.observe(1.2, forecast_s=0.3, measured_s=0.3)
    assert forecast.error_s(1.2) == pytest.approx(0.0)
    # Ten on time, then ten admitted requests all still waiting 1 s past their forecast:
    # the error says so while they wait, not a TTFT later.
    for i in range(10):
        forecast.admitted(f"late{i}", arrival=2.0, forecast_s=0.5)
    assert forecast.error_s(3.5) == pytest.approx(1.0)
    for i in range(10):
        forecast.forget(f"late{i}")  # e.g. their clients went away
    forecast.forget("b")
    assert forecast.error_s(3.5) == pytest.approx(0.0)


def test_slot_limit_is_never_cut_below_the_free_batch():
    """Steps that miss the target even at a batch of one: refusing down to one request would
    not make them faster, only refuse more."""
    limit = DecodeSlotLimit(0.05, initial=8)
    for t in range(20):
        limit.observe(t * 0.1, 0.2, 1)  # 200 ms per token against 50 ms
    limit.update(2.0, in_flight=3, floor=4)
    assert limit.limit == 8 and limit.cuts == 0  # 3 in flight, under the free batch of 4
    for t in range(20, 40):
        limit.observe(t * 0.1, 0.2, 1)
    limit.update(4.0, in_flight=8, floor=4)
    assert limit.limit == 4 and limit.cuts == 1  # cut, but to the free batch, not to 1
