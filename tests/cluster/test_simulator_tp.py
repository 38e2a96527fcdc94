"""Tensor parallelism per pool in the cost model, the simulator and `plan`: the all-reduce
costs what a ring within a node costs, each pool's replicas take their own tp of GPUs, and
the search picks each phase's degree (DistServe's per-phase parallelism)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from cluster.config import PoolConfig, SLOConfig
from cluster.simulator.cli import add_plan_parser
from cluster.simulator.cluster_model import SimConfig
from cluster.simulator.cost_model import CostModel, ModelShape
from cluster.simulator.hardware import hardware
from cluster.simulator.search import PlanSpec, plan, tp_options
from cluster.simulator.simulation import Simulation, simulate
from cluster.simulator.workload import poisson
from workers.pool import Pool

H100_70B = CostModel(hardware("H100"), ModelShape.load("llama3-70b"), tp=4)
H100_8B = CostModel(hardware("H100"), ModelShape.load("llama3-8b"))


def test_allreduce_is_a_ring_within_the_node():
    m, hw = H100_70B.model, H100_70B.hardware
    assert replace(H100_70B, tp=1).allreduce_time(512) == 0.0
    t, tokens = 4, 512
    nbytes = tokens * m.hidden_size * m.dtype_bytes
    link = hw.intra_node_link_bw * H100_70B.efficiency.link_efficiency
    one = 2 * (t - 1) * (hw.allreduce_hop_s + nbytes / t / link)
    assert H100_70B.allreduce_time(tokens) == pytest.approx(2 * m.num_layers * one)
    # A decode step pays it too: tp 8 is faster than tp 4, but by less than 2x.
    step4 = H100_70B.decode_step_time(32, 32 * 2048)
    step8 = replace(H100_70B, tp=8).decode_step_time(32, 32 * 2048)
    assert step4 / 2 < step8 < step4


def test_tp_options_split_the_heads_and_fit_the_weights():
    assert tp_options(replace(H100_70B, tp=1), 8) == (2, 4, 8)  # 140 GB > one 80 GB GPU
    assert tp_options(H100_8B, 8) == (1, 2, 4, 8)
    nine_heads = replace(H100_8B.model, num_heads=9, num_kv_heads=3, head_dim=64)
    assert tp_options(replace(H100_8B, model=nine_heads), 8) == (1,)


def test_each_pool_counts_its_own_tp_of_gpus():
    config = SimConfig(
        H100_8B,
        SLOConfig(ttft_ms=1000, tpot_ms=100),
        prefill=PoolConfig(replicas=2),
        decode=PoolConfig(replicas=3),
        prefill_tp=4,
        decode_tp=2,
    )
    assert (config.tp(Pool.PREFILL), config.tp(Pool.DECODE)) == (4, 2)
    assert config.cost_for(Pool.PREFILL).tp == 4 and config.transfer_cost().tp == 2
    workload = poisson(2.0, 30.0, "512", "64", seed=0)
    assert Simulation(config, workload).gpus == 2 * 4 + 3 * 2
    result = simulate(config, workload)
    faster = simulate(
        replace(config, prefill_tp=1), poisson(2.0, 30.0, "512", "64", seed=0)
    ).summary()
    assert faster["ttft_p50_ms"] > result.summary()["ttft_p50_ms"]  # tp 4 prefills faster


def test_plan_chooses_each_phase_tp():
    spec = PlanSpec(
        replace(H100_70B, tp=1),
        SLOConfig(ttft_ms=400, tpot_ms=60),
        "1024",
        "128",
        requests=300,
        tp_choices=(2, 4, 8),
    )
    disagg, coloc = plan(spec, 4.0)
    assert disagg.prefill_tp in (2, 4, 8) and disagg.decode_tp in (2, 4, 8)
    assert disagg.gpus == disagg.prefill * disagg.prefill_tp + disagg.decode * disagg.decode_tp
    assert coloc.gpus == coloc.colocated * coloc.colocated_tp
    assert f"prefill (tp {disagg.prefill_tp})" in disagg.describe()
    assert disagg.result.attainment() >= 0.9


def test_plan_cli_prints_each_pool_tp(capsys):
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        "plan --model llama3-8b --hardware H100 --rate 10 --input-len 512 --output-len 64 "
        "--slo-ttft-ms 500 --slo-tpot-ms 50 --requests 200 --prefill-tp 2 --json".split()
    )
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["disaggregated"]["prefill_tp"] == 2 and out["disaggregated"]["decode_tp"] == 1
    assert (
        out["disaggregated"]["gpus"]
        == 2 * out["disaggregated"]["prefill"] + out["disaggregated"]["decode"]
    )
