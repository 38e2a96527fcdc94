"""A replica's step cost from its own steps: the capacity admission and the planner read."""

from __future__ import annotations

import pytest

from engine.step_cost import StepCost, StepCostModel


def test_decode_terms_come_from_the_batch_sizes_seen():
    model = StepCostModel()
    assert model.estimate() is None
    for batch in (1, 2, 4, 8, 16):
        for _ in range(10):
            model.record(batch, 0, 0.05 + 0.003 * batch)
    cost = model.estimate()
    assert cost.base_s == pytest.approx(0.05, abs=2e-3)
    assert cost.per_seq_s == pytest.approx(0.003, rel=0.05)
    assert cost.decode_steps == 50 and cost.per_token_s == 0.0


def test_one_batch_size_says_nothing_of_the_slope_so_the_prior_holds_it():
    prior = StepCost(base_s=0.04, per_seq_s=0.002, per_token_s=0.001)
    model = StepCostModel(prior)
    for _ in range(100):
        model.record(1, 0, 0.05)  # steps at batch 1, a bit slower than calibrated
    cost = model.estimate()
    assert cost.decode_step_s(1) == pytest.approx(0.05, rel=0.02)
    assert cost.per_seq_s == pytest.approx(0.002, rel=0.3)  # not invented from one point
    assert cost.per_token_s == 0.001  # no prompt steps: the prior's


def test_prompt_speed_is_the_time_prompt_steps_took_per_token():
    model = StepCostModel()
    model.record(0, 128, 1.0)
    model.record(3, 256, 2.2)  # a colocated step: its decode rows ride along
    cost = model.estimate()
    assert cost.per_token_s == pytest.approx(3.2 / 384)
    assert cost.prefill_tokens_per_s == pytest.approx(120.0)


def test_free_batch_is_where_a_step_costs_at_most_a_quarter_more_than_one():
    assert StepCost(0.1, 0.002, 0.0).free_batch() == 13
    assert StepCost(0.1, 0.0, 0.0).free_batch(limit=64) == 64  # batching is free
    assert StepCost(0.001, 0.01, 0.0).free_batch() == 1
