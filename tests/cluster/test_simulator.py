"""The cluster simulator: cost model, workloads, the event loop, the planner under
simulation, the capacity search and the CLI glue. Small workloads: the whole file runs in
a few seconds."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from cluster.config import ClusterConfig, PlannerConfig, PoolConfig, SLOConfig
from cluster.simulator.cli import add_plan_parser, add_simulate_parser
from cluster.simulator.cluster_model import SimConfig
from cluster.simulator.cost_model import (
    OPT_13B,
    CostModel,
    Efficiency,
    Measurements,
    ModelShape,
    calibrate,
)
from cluster.simulator.hardware import PRESETS, hardware
from cluster.simulator.report import recovery_time
from cluster.simulator.search import PlanSpec, max_rate, plan
from cluster.simulator.simulation import simulate
from cluster.simulator.workload import (
    burst_rate,
    generate,
    load_trace,
    parse_length,
    poisson,
    rate_pattern,
)

CONFIGS = Path(__file__).resolve().parents[2] / "cluster" / "configs"
H100_8B = CostModel(hardware("H100"), ModelShape.load("llama3-8b"))


# ---- example configs ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "path", sorted(p for p in CONFIGS.glob("*.yaml") if p.name != "ray-up-gpu.yaml")
)
def test_example_cluster_configs_load(path):
    config = ClusterConfig.from_yaml(path)
    for pool in ("prefill", "decode"):
        assert getattr(config, pool).min <= getattr(config, pool).initial


def test_ray_up_yaml_has_gpu_node_types_that_can_scale():
    data = yaml.safe_load((CONFIGS / "ray-up-gpu.yaml").read_text())
    assert data["provider"]["type"] in ("aws", "gcp")
    workers = {k: v for k, v in data["available_node_types"].items() if k != data["head_node_type"]}
    assert workers and all(v["resources"]["GPU"] >= 2 for v in workers.values())
    assert any(v["max_workers"] > v["min_workers"] for v in workers.values())
    assert any("pip install" in c for c in data["setup_commands"])
    assert data["head_start_ray_commands"] and data["worker_start_ray_commands"]


# ---- cost model ----------------------------------------------------------------------------
def test_model_shapes_from_config_json():
    opt = ModelShape.from_hf_dict(OPT_13B, "opt-13b")
    assert (opt.num_layers, opt.num_kv_heads, opt.head_dim, opt.gated_mlp) == (40, 40, 128, False)
    assert 12.5e9 < opt.matmul_params < 13.5e9
    assert opt.kv_bytes_per_token() == 2 * 40 * 40 * 128 * 2  # MHA fp16: 800 KiB/token
    tiny = ModelShape.load("tiny")
    assert tiny.num_kv_heads == 2 and tiny.dtype_bytes == 4


def test_roofline_regimes():
    c = H100_8B
    # Decode at batch 1 streams the weights: memory-bound.
    weights_s = c.model.weight_bytes / c.bandwidth
    assert c.decode_step_time(1, 512) == pytest.approx(weights_s + 2e-3 + 2e-5, rel=0.05)
    # A large batch of long prompts is compute-bound: time grows linearly with tokens.
    t1, t2 = c.prefill_time(4096, 4 * 1024**2), c.prefill_time(8192, 8 * 1024**2)
    assert (t2 - 2e-3) / (t1 - 2e-3) == pytest.approx(2.0, rel=0.02)
    # H200 decodes faster than H100 (bandwidth), prefills the same (compute).
    h200 = replace(c, hardware=hardware("H200"))
    assert h200.decode_step_time(64, 64 * 1024) < c.decode_step_time(64, 64 * 1024)
    assert h200.prefill_time(8192, 8 * 1024**2) == pytest.approx(c.prefill_time(8192, 8 * 1024**2))
    assert c.transfer_time(1024) < 0.01 and set(PRESETS) >= {"A100", "H100", "H200", "CPU"}


def test_calibrate_recovers_efficiencies_and_overheads():
    truth = replace(
        H100_8B,
        efficiency=Efficiency(mfu=0.3, attention=0.4, forward_overhead_s=5e-3, per_seq_s=1e-4),
    )
    measured = Measurements(
        prefill=tuple(
            (n, n_len, truth.prefill_time(n * n_len, n * n_len**2, n))
            for n, n_len in ((1, 512), (1, 4096), (8, 512), (4, 2048))
        ),
        decode=tuple((b, 576.0, truth.decode_step_time(b, b * 576.0)) for b in (1, 8, 32)),
    )
    fitted = calibrate(H100_8B, measured)
    e = fitted.efficiency
    assert e.forward_overhead_s == pytest.approx(5e-3, rel=0.1)
    assert e.mfu == pytest.approx(0.3, rel=0.05) and e.attention == pytest.approx(0.4, rel=0.1)
    for n, n_len, t in measured.prefill:
        assert fitted.prefill_time(n * n_len, n * n_len**2, n) == pytest.approx(t, rel=0.03)
    for b, ctx, t in measured.decode:
        assert fitted.decode_step_time(b, b * ctx) == pytest.approx(t, rel=0.05)
    bench = {"engine": [{"concurrency": 8, "prefill_tok_s": 4000.0, "decode_tok_s": 800.0}]}
    m = Measurements.from_bench_json(bench, prompt_len=128, output_len=64)
    assert m.prefill == ((8, 128, 0.256),) and m.decode == ((8, 160.0, 0.01),)


def test_cpu_calibration_reproduces_the_measured_tiny_engine():
    from benchmarks.sim_bench import CPU_CALIBRATION, cpu_cost_model

    cost = cpu_cost_model()
    data = json.loads(CPU_CALIBRATION.read_text())
    for n, n_len, t in data["prefill"]:
        assert cost.prefill_time(n * n_len, n * n_len**2, n) == pytest.approx(t, rel=0.3)
    for b, ctx, t in data["decode"]:
        assert cost.decode_step_time(b, b * ctx) == pytest.approx(t, rel=0.3)


# ---- workloads -----------------------------------------------------------------------------
def test_length_distributions_and_traces(tmp_path):
    rng = np.random.default_rng(0)
    assert (parse_length("7")(rng, 5) == 7).all()
    assert parse_length("lognormal:500:0.8")(rng, 20000).mean() == pytest.approx(500, rel=0.05)
    assert parse_length("uniform:3:5")(rng, 1000).min() >= 3
    with pytest.raises(ValueError, match="bad length"):
        parse_length("gamma:3")
    w = poisson(20, 100, "128", "exp:32", seed=1)
    assert len(w) == pytest.approx(2000, rel=0.1) and (np.diff(w.arrival_s) >= 0).all()
    w.save_csv(tmp_path / "t.csv")
    back = load_trace(tmp_path / "t.csv")
    assert len(back) == len(w) and (back.output_len == w.output_len).all()
    (tmp_path / "t.jsonl").write_text('{"arrival_s": 1.0, "input_len": 5, "output_len": 2}\n')
    assert len(load_trace(tmp_path / "t.jsonl")) == 1
    day = generate("diurnal", 10, 86400, "100", "10")
    night, noon = (
        (day.arrival_s < 3600).sum(),
        ((day.arrival_s > 41400) & (day.arrival_s < 45000)).sum(),
    )
    assert noon > 3 * night
    assert len(load_trace(CONFIGS / "traces" / "example-burst.csv")) > 1000


# ---- the event loop ------------------------------------------------------------------------
def test_light_load_latency_is_the_cost_model():
    w = poisson(0.5, 200, "1024", "128", seed=2)
    r = simulate(SimConfig(H100_8B), w)
    assert r.finished.all()
    alone = H100_8B.prefill_time(1024, 1024**2)
    assert r.percentile("ttft", 50) == pytest.approx(alone, rel=0.01)
    step = H100_8B.decode_step_time(1, 1024 + 64)
    assert r.percentile("tpot", 50) == pytest.approx(step, rel=0.1)


def test_queueing_and_overload():
    def ttft_p90(rate):
        return simulate(SimConfig(H100_8B), poisson(rate, 60, "2048", "16", seed=3)).percentile(
            "ttft", 90
        )

    light, heavy = ttft_p90(2), ttft_p90(14)
    assert heavy > 2 * light
    # KV is reserved before prefill: a decode pool with 8 seats makes the rest wait.
    r = simulate(SimConfig(H100_8B, max_num_seqs=8), poisson(20, 30, "256", "256", seed=3))
    assert r.finished.all() and r.percentile("ttft", 90) > 1.0


def test_colocated_prefill_stalls_decode():
    w = poisson(6, 120, "4096", "256", seed=4)
    disagg = simulate(SimConfig(H100_8B), w)
    coloc = simulate(SimConfig(H100_8B, mode="colocated", colocated=PoolConfig(replicas=2)), w)
    assert coloc.percentile("tpot", 90) > 1.3 * disagg.percentile("tpot", 90)


# ---- the planner under simulation ----------------------------------------------------------
PLANNER = PlannerConfig(enabled=True, interval_s=10, cooldown_s=60, max_step=2, warmup_s=20)
POOLS = dict(
    prefill=PoolConfig(min_replicas=1, max_replicas=32, initial_replicas=2),
    decode=PoolConfig(min_replicas=1, max_replicas=32, initial_replicas=2),
)
SLO = SLOConfig(ttft_ms=500, tpot_ms=50)


def test_planner_no_flapping_under_steady_load():
    w = poisson(40, 1200, "lognormal:1024:0.5", "exp:256", seed=1)
    r = simulate(SimConfig(H100_8B, SLO, planner=PLANNER, startup_s=30, **POOLS), w)
    assert r.attainment() > 0.95
    for pool in ("prefill", "decode"):
        moves = [d.direction for d in r.decisions if d.pool == pool]
        reversals = sum(1 for a, b in zip(moves, moves[1:], strict=False) if a != b)
        assert reversals == 0, moves


def test_planner_recovers_from_a_3x_burst():
    w = rate_pattern(
        burst_rate(40, 3.0, 600, 300), 120, 1200, "lognormal:1024:0.5", "exp:256", seed=2
    )
    r = simulate(SimConfig(H100_8B, SLO, planner=PLANNER, startup_s=30, **POOLS), w)
    # Recovery: replica start-up (30 s) + warm-up (20 s) + a few planner intervals.
    assert recovery_time(r, 600) <= 120
    assert max(row["prefill"] for row in r.ticks) >= 4
    assert r.ticks[-1]["prefill"] < max(row["prefill"] for row in r.ticks)  # scales back down
    assert all(d.reason for d in r.decisions)


# ---- plan ----------------------------------------------------------------------------------
def test_plan_finds_configurations_that_meet_the_slo():
    spec = PlanSpec(H100_8B, SLO, "512", "128", requests=400)
    disagg, coloc = plan(spec, 30.0)
    assert disagg.result.attainment() >= 0.9 and coloc.result.attainment() >= 0.9
    assert disagg.gpus == disagg.prefill + disagg.decode
    assert disagg.max_goodput >= 30.0 * 0.97 and coloc.max_goodput >= 30.0 * 0.97
    one = max_rate(spec, spec.config(1, 1))
    assert 0 < one <= disagg.max_goodput * 1.03  # 1 + 1 is the smallest disaggregated set


# ---- CLI glue ------------------------------------------------------------------------------
def _parser():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_plan_parser(sub)
    add_simulate_parser(sub)
    return parser


def test_plan_cli(capsys, tmp_path):
    args = _parser().parse_args(
        "plan --model llama3-8b --hardware H100 --rate 20 --input-len 512 --output-len 64 "
        f"--slo-ttft-ms 500 --slo-tpot-ms 50 --requests 300 --json --plot {tmp_path / 'a.png'}".split()
    )
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["disaggregated"]["attainment"] >= 0.9 and out["colocated"]["gpus"] >= 1
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_simulate_cli_with_a_config_and_a_trace(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    data = yaml.safe_load((CONFIGS / "gpu-8x-node.yaml").read_text())
    config.write_text(yaml.safe_dump(data))
    trace = CONFIGS / "traces" / "example-burst.csv"
    args = _parser().parse_args(
        f"simulate --config {config} --trace {trace} --model llama3-8b --plot {tmp_path / 's.png'}".split()
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "SLO attainment" in out and "GPU-hours" in out
    assert (tmp_path / "s.png").stat().st_size > 1000
