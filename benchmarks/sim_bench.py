"""Simulator benchmarks and checks behind benchmarks/RESULTS.md ("Planner and simulator").

    python -m benchmarks.sim_bench measure-cpu --out FILE   # tiny engine on this CPU → calibration
    python -m benchmarks.sim_bench scale                    # 1,000 GPUs, 1 hour: wall time
    python -m benchmarks.sim_bench burst                    # planner: steady load, 3x burst
    python -m benchmarks.sim_bench opt13b                   # DistServe's chatbot setting
    python -m benchmarks.sim_bench calibrate-serve --serve-json LOW.json --probe PREFIX \
        --out benchmarks/sim_serving_cpu_tiny.json
        # fit the serving overheads (cluster/simulator/serving.py) to a low-load run made by
        # benchmarks/serve_calibration_run.sh (PREFIX: its snapshots, benchmarks/out/serve_TAG)
    python -m benchmarks.sim_bench cpu-serve --serve-json F [--serving S] [--probe PREFIX]
        # replay a `pdcluster bench serve --json-out F` run (its exact arrivals and lengths)
        # through the simulator calibrated on this CPU; TTFT/TPOT percentiles side by side;
        # with --probe, again with the CPU other jobs took during that run added
    python -m benchmarks.sim_bench trim-serve --serve-json F --out G
        # the fields a replay needs, small enough to commit (benchmarks/serve_runs/)

Calibration files hold ``{"prefill": [[prompts, len, s], ...], "decode": [[batch, ctx, s], ...]}``
(:class:`cluster.simulator.cost_model.Measurements`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from cluster.config import PlannerConfig, PoolConfig, SLOConfig
from cluster.simulator.cluster_model import SimConfig
from cluster.simulator.cost_model import (
    CPU_EFFICIENCY,
    CostModel,
    Measurements,
    ModelShape,
    calibrate,
)
from cluster.simulator.hardware import hardware
from cluster.simulator.report import recovery_time
from cluster.simulator.search import PlanSpec, plan, tp_options
from cluster.simulator.serving import NO_OVERHEADS, ServingOverheads
from cluster.simulator.serving_fit import (
    ServeProbe,
    ServeRun,
    fit_serving,
    foreign_load,
    replay,
)
from cluster.simulator.simulation import simulate
from cluster.simulator.workload import burst_rate, poisson, rate_pattern

CPU_CALIBRATION = Path(__file__).with_name("sim_calibration_cpu_tiny.json")
CPU_SERVING = Path(__file__).with_name("sim_serving_cpu_tiny.json")


def measure_cpu(out: str) -> int:
    """Prefill time vs (prompts, length) and decode step time vs batch of the tiny engine,
    one torch thread (as a worker of local-cpu.yaml runs). ~10 s of one core."""
    import torch

    from engine import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM("tiny", progress=False, max_num_seqs=64, max_num_batched_tokens=4096)
    gen = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return torch.randint(3, 256, (n, length), generator=gen).tolist()

    def median_s(fn, reps: int = 3) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return sorted(times)[reps // 2]

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate(prompts(2, 64), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    prefill = []
    for n, length in ((1, 128), (1, 512), (1, 1024), (4, 128), (8, 128), (8, 256)):
        prefill.append(
            (n, length, median_s(lambda n=n, length=length: llm.generate(prompts(n, length), one)))
        )
    decode, steps = [], 32
    full = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for b in (1, 8, 32):
        t_prefill = median_s(lambda b=b: llm.generate(prompts(b, 128), one))
        t_total = median_s(lambda b=b: llm.generate(prompts(b, 128), full))
        decode.append((b, 128 + steps / 2, (t_total - t_prefill) / steps))
    Path(out).write_text(json.dumps({"prefill": prefill, "decode": decode}, indent=1))
    for n, length, t in prefill:
        print(f"prefill {n} x {length}: {t * 1e3:.1f} ms ({n * length / t:,.0f} tok/s)")
    for b, _, t in decode:
        print(f"decode batch {b}: {t * 1e3:.2f} ms/step")
    print(f"wrote {out}")
    return 0


def cpu_cost_model(calibration: str | Path = CPU_CALIBRATION) -> CostModel:
    """The tiny model on the CPU preset, calibrated (fp32 KV, as local-cpu.yaml runs).
    ``calibration``: a `measure-cpu` file, or several joined by commas (taken around one
    serve run: their times are averaged)."""
    files = [json.loads(Path(f).read_text()) for f in str(calibration).split(",")]

    def mean(key: str) -> tuple:
        rows = [d[key] for d in files]
        if any(len(r) != len(rows[0]) for r in rows):
            raise ValueError(f"calibration files differ in their {key} rows")
        return tuple(
            (*row[:-1], float(np.mean([r[i][-1] for r in rows]))) for i, row in enumerate(rows[0])
        )

    measured = Measurements(mean("prefill"), mean("decode"))
    base = CostModel(
        hardware("CPU"), ModelShape.load("tiny"), efficiency=CPU_EFFICIENCY, kv_cache_bytes=4
    )
    return calibrate(base, measured)


def served_config(calibration: str | Path = CPU_CALIBRATION, serving=NO_OVERHEADS) -> SimConfig:
    """`pdcluster serve`'s default layout on this CPU: 1 prefill + 1 decode actor, 64 seqs,
    a 2,048-token prefill budget, 16,384 blocks of 16 tokens of KV per actor."""
    return SimConfig(
        cpu_cost_model(calibration),
        max_batched_tokens=2048,
        max_num_seqs=64,
        kv_tokens=16384 * 16,
        serving=serving,
    )


def load_run(serve_json: str | Path) -> ServeRun:
    return ServeRun.from_bench_json(json.loads(Path(serve_json).read_text()))


def calibrate_serve(serve_json: str, probe: str | None, calibration: str, out: str) -> int:
    """Fit the serving overheads to a low-load run (and its probe snapshots, if given)."""
    run = load_run(serve_json)
    probe_data = None
    if probe:
        snap = {
            k: json.loads(Path(f"{probe}.{k}.json").read_text())
            for k in ("idle", "before", "after")
        }
        client = _client_cpu_s(probe)
        tokens = int(sum(run.workload.output_len))
        probe_data = ServeProbe.from_snapshots(
            snap["idle"], snap["before"], snap["after"], client, tokens, os.cpu_count() or 1
        )
        print(f"probe: {probe_data}")
    overheads = fit_serving(served_config(calibration), run, probe_data)
    overheads.to_json(
        out,
        fitted_on=f"{Path(serve_json).name} ({run.rate:g} req/s, {len(run.workload)} requests)",
        engine_calibration=",".join(os.path.relpath(f) for f in str(calibration).split(",")),
        command=f"python -m benchmarks.sim_bench calibrate-serve --serve-json {serve_json}"
        + (f" --probe {probe}" if probe else "")
        + (f" --calibration {calibration}" if str(calibration) != str(CPU_CALIBRATION) else "")
        + f" --out {out}",
    )
    print(f"fitted: {overheads.describe()}")
    print(f"wrote {out}")
    return compare(run, served_config(calibration, overheads))


def _client_cpu_s(probe: str, with_startup: bool = False) -> float:
    """The load generator's CPU seconds (`/usr/bin/time` user + system), less its start-up
    (imports, measured by the same tool on `bench serve --help`) unless ``with_startup``."""

    def cpu(path: str) -> float:
        user, system, *_ = Path(path).read_text().split()
        return float(user) + float(system)

    total = cpu(f"{probe}.bench_cpu")
    startup = Path(f"{probe}.client_startup_cpu")
    if with_startup or not startup.exists():
        return total
    return max(total - cpu(str(startup)), 0.0)


def cpu_serve(serve_json: str, calibration: str, serving: str | None, probe: str | None) -> int:
    """Replay a measured `pdcluster bench serve` run on `pdcluster serve`'s layout with the
    serving overheads of ``serving`` (None: the bare engine's cost model alone). With
    ``probe`` (the run's snapshots), replay it also with the cores other jobs used during
    the run added to the background."""
    overheads = ServingOverheads.from_json(serving) if serving else NO_OVERHEADS
    run = load_run(serve_json)
    compare(run, served_config(calibration, overheads))
    if probe and overheads.shares_cpu:
        before, after = (
            json.loads(Path(f"{probe}.{k}.json").read_text()) for k in ("before", "after")
        )
        foreign = foreign_load(before, after, _client_cpu_s(probe, with_startup=True))
        if foreign is None:
            print("(the probe did not record the machine's CPU: no foreign load)")
            return 0
        print(f"\nwith the {foreign:.2f} cores other jobs used during the run:")
        more = replace(overheads, background_cpu_s=overheads.background_cpu_s + foreign)
        compare(run, served_config(calibration, more))
    return 0


def compare(run: ServeRun, config: SimConfig) -> int:
    """Print measured vs simulated TTFT/TPOT p50/p90 and the worst error."""
    sim = replay(config, run)
    w = run.workload
    print(
        f"{len(w)} requests at {run.rate:g} req/s, input mean {w.input_len.mean():.0f}, "
        f"output mean {w.output_len.mean():.0f}; serving: {config.serving.describe()}"
    )
    print(f"{'':10}{'measured':>10}{'simulated':>10}{'error':>8}")
    worst = 0.0
    for which in ("ttft", "tpot"):
        for p in (50, 90):
            real = run.percentile(which, p) * 1e3
            simulated = sim.percentile(which, p) * 1e3
            err = simulated / real - 1
            worst = max(worst, abs(err))
            print(f"{which} p{p:<5}{real:>10.1f}{simulated:>10.1f}{err:>+8.0%}")
    print(f"worst error {worst:.0%} ({'within' if worst <= 0.25 else 'OUTSIDE'} 25%)")
    return 0


def trim_serve(serve_json: str, out: str) -> int:
    """Keep what a replay needs of a `bench serve --json-out` file: config, summary, and per
    request its start, lengths, outcome, TTFT and TPOT (rounded to 0.1 ms)."""
    data = json.loads(Path(serve_json).read_text())
    keep = ("input_len", "output_len", "num_tokens", "ok")
    requests = [
        {
            **{k: r[k] for k in keep},
            **{
                k: None if r[k] is None else round(r[k], 5) for k in ("start_s", "ttft_s", "tpot_s")
            },
        }
        for r in data["requests"]
    ]
    trimmed = {"config": data["config"], "summary": data["summary"], "requests": requests}
    Path(out).write_text(json.dumps(trimmed, separators=(",", ":")) + "\n")
    print(f"wrote {out} ({len(requests)} requests)")
    return 0


def scale() -> int:
    """1,000 H100s for an hour: Llama-3-70B at tp 8 (125 replicas), long documents,
    sinusoidal load 350–550 req/s, the planner on."""
    cost = CostModel(hardware("H100"), ModelShape.load("llama3-70b"), tp=8, kv_cache_bytes=1)
    t0 = time.perf_counter()
    workload = rate_pattern(
        lambda t: 450 + 100 * np.sin(2 * np.pi * np.asarray(t) / 3600),
        550,
        3600,
        "lognormal:4096:0.6",
        "lognormal:512:0.8",
        seed=0,
    )
    t1 = time.perf_counter()
    config = SimConfig(
        cost,
        SLOConfig(ttft_ms=3000, tpot_ms=60),
        prefill=PoolConfig(min_replicas=8, max_replicas=110, initial_replicas=90),
        decode=PoolConfig(min_replicas=4, max_replicas=40, initial_replicas=30),
        planner=PlannerConfig(enabled=True, interval_s=10, cooldown_s=120, max_step=4, warmup_s=30),
        startup_s=90,
    )
    result = simulate(config, workload)
    t2 = time.perf_counter()
    gpus = [row["gpus"] for row in result.ticks]
    s = result.summary()
    print(
        f"{len(workload):,} requests, GPUs {min(gpus)}–{max(gpus)} (mean {np.mean(gpus):.0f}), "
        f"{s['gpu_hours']:.0f} GPU-hours, attainment {s['attainment']:.2%}, "
        f"{s['scaling_actions']} scaling actions"
    )
    print(f"trace generation {t1 - t0:.1f} s, simulation {t2 - t1:.1f} s wall")
    return 0


def burst() -> int:
    """Llama-3-8B on H100 (tp 1), 1,024/256-token requests at 40 req/s: 20 min steady, and
    a 3x burst for 5 min; planner every 10 s, replicas ready 30 s after the decision."""
    cost = CostModel(hardware("H100"), ModelShape.load("llama3-8b"))
    planner = PlannerConfig(enabled=True, interval_s=10, cooldown_s=60, max_step=2, warmup_s=20)
    pools = dict(
        prefill=PoolConfig(min_replicas=1, max_replicas=32, initial_replicas=2),
        decode=PoolConfig(min_replicas=1, max_replicas=32, initial_replicas=2),
    )
    slo = SLOConfig(ttft_ms=500, tpot_ms=50)
    config = SimConfig(cost, slo, planner=planner, startup_s=30, **pools)
    steady = simulate(config, poisson(40, 1200, "lognormal:1024:0.5", "exp:256", seed=1))
    print(f"steady 40 req/s, 20 min: attainment {steady.attainment():.1%}, scaling actions:")
    for d in steady.decisions:
        print(f"  t={d.time_s:.0f} {d.pool} {d.current}→{d.target}: {d.reason}")
    w = rate_pattern(
        burst_rate(40, 3.0, 600, 300), 120, 1500, "lognormal:1024:0.5", "exp:256", seed=2
    )
    r = simulate(config, w)
    peak = {p: max(row[p] for row in r.ticks) for p in ("prefill", "decode")}
    print(
        f"3x burst at t=600–900 s: attainment {r.attainment():.1%} overall, back at ≥90% per "
        f"10-s window {recovery_time(r, 600):.0f} s after the burst began; peak replicas {peak}; "
        f"{len(r.decisions)} scaling actions"
    )
    for d in r.decisions:
        print(f"  t={d.time_s:.0f} {d.pool} {d.current}→{d.target}: {d.reason}")
    return 0


def opt13b() -> int:
    """DistServe's chatbot setting: OPT-13B on A100s, TTFT 0.25 s / TPOT 0.1 s at 90%: one
    tp for every pool (1), then each pool's tp searched (1, 2, 4, 8), as DistServe does."""
    cost = CostModel(hardware("A100"), ModelShape.load("opt-13b"))
    base = PlanSpec(
        cost,
        SLOConfig(ttft_ms=250, tpot_ms=100, percentile=90),
        "lognormal:755:0.8",
        "lognormal:200:0.8",
    )
    searched = replace(base, tp_choices=tp_options(cost, cost.hardware.gpus_per_node))
    return compare_plans((("tp 1", base), ("tp per pool", searched)), (5.0, 10.0, 20.0))


def compare_plans(specs, rates) -> int:
    """For each (label, spec) and rate: the disaggregated and colocated plans, and their
    goodput per GPU as a ratio."""
    for (label, spec), rate in itertools.product(specs, rates):
        disagg, coloc = plan(spec, rate)
        print(f"{label}, {rate:g} req/s:")
        print(f"  disaggregated: {disagg.describe()}")
        print(f"  colocated:     {coloc.describe()}")
        print(
            f"  goodput/GPU disaggregated ÷ colocated: {disagg.goodput_per_gpu / coloc.goodput_per_gpu:.2f}x"
        )
    return 0


def llama70b() -> int:
    """Llama-3-70B on H100s (fp8 KV), 2,048-token prompts / 256-token answers, TTFT 1 s and
    TPOT 50 ms at p90: every pool at tp 8, then each pool's tp searched among the degrees
    whose weights fit (2, 4, 8)."""
    cost = CostModel(hardware("H100"), ModelShape.load("llama3-70b"), tp=8, kv_cache_bytes=1)
    uniform = PlanSpec(
        cost,
        SLOConfig(ttft_ms=1000, tpot_ms=50, percentile=90),
        "lognormal:2048:0.6",
        "lognormal:256:0.8",
    )
    searched = replace(uniform, tp_choices=tp_options(cost, cost.hardware.gpus_per_node))
    print(f"degrees whose weights fit: {searched.tp_choices}")
    return compare_plans((("tp 8", uniform), ("tp per pool", searched)), (5.0, 20.0, 50.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure-cpu")
    m.add_argument("--out", default=str(CPU_CALIBRATION))
    c = sub.add_parser("cpu-serve")
    c.add_argument("--serve-json", required=True)
    c.add_argument("--calibration", default=str(CPU_CALIBRATION))
    c.add_argument("--serving", default=None, help="serving overheads JSON (default: none)")
    c.add_argument("--probe", default=None, help="benchmarks/out/serve_TAG: its snapshots")
    f = sub.add_parser("calibrate-serve")
    f.add_argument("--serve-json", required=True, help="a LOW-load run (rate 1-2)")
    f.add_argument("--probe", default=None, help="benchmarks/out/serve_TAG: its snapshots")
    f.add_argument("--calibration", default=str(CPU_CALIBRATION))
    f.add_argument("--out", default=str(CPU_SERVING))
    t = sub.add_parser("trim-serve")
    t.add_argument("--serve-json", required=True)
    t.add_argument("--out", required=True)
    for name in ("scale", "burst", "opt13b", "llama70b"):
        sub.add_parser(name)
    args = parser.parse_args(argv)
    if args.cmd == "measure-cpu":
        return measure_cpu(args.out)
    if args.cmd == "cpu-serve":
        return cpu_serve(args.serve_json, args.calibration, args.serving, args.probe)
    if args.cmd == "calibrate-serve":
        return calibrate_serve(args.serve_json, args.probe, args.calibration, args.out)
    if args.cmd == "trim-serve":
        return trim_serve(args.serve_json, args.out)
    scenarios = {"scale": scale, "burst": burst, "opt13b": opt13b, "llama70b": llama70b}
    return scenarios[args.cmd]()


if __name__ == "__main__":
    sys.exit(main())
