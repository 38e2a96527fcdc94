"""``pdcluster plan`` and ``pdcluster simulate`` (wired into cluster/cli.py by its owner).

Both take a model shape (``--model``: a config.json, a checkpoint directory, ``tiny``,
``opt-13b``, ``llama3-8b``, ``llama3-70b``) and a hardware preset (``--hardware``:
A100, H100, H200, CPU), optionally calibrated with ``--calibration FILE`` (the JSON of
``pdcluster bench engine --json-out``, with ``--calibration-lengths IN,OUT`` it ran with).
"""

from __future__ import annotations

import json
import sys

from cluster.config import SLOConfig


def _add_model_options(p) -> None:
    p.add_argument(
        "--model",
        default="tiny",
        help="config.json, checkpoint dir, tiny, opt-13b, llama3-8b, llama3-70b",
    )
    p.add_argument(
        "--hardware", default=None, help="A100, H100, H200 or CPU (default: H100; CPU for tiny)"
    )
    p.add_argument(
        "--tp",
        default="1",
        help="devices per replica (tensor parallel), or 'auto' (plan: the best per pool)",
    )
    p.add_argument("--prefill-tp", type=int, default=None, help="plan: the prefill pool's tp")
    p.add_argument("--decode-tp", type=int, default=None, help="plan: the decode pool's tp")
    p.add_argument(
        "--calibration",
        default=None,
        help="`pdcluster bench engine --json-out` file, or a measure-cpu JSON "
        "(benchmarks/sim_calibration_cpu_tiny.json)",
    )
    p.add_argument(
        "--calibration-lengths", default="128,64", help="IN,OUT lengths of that bench run"
    )
    p.add_argument("--max-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)


def build_cost_model(args):
    from cluster.simulator.cost_model import (
        CPU_EFFICIENCY,
        CostModel,
        Measurements,
        ModelShape,
        calibrate,
    )
    from cluster.simulator.hardware import hardware

    shape = ModelShape.load(args.model)
    hw = hardware(args.hardware or ("CPU" if args.model == "tiny" else "H100"))
    kw = {"efficiency": CPU_EFFICIENCY} if hw.name == "CPU" else {}
    tp = 1 if str(args.tp) == "auto" else _positive_int(args.tp, "--tp")
    cost = CostModel(hw, shape, tp=tp, **kw)
    if args.calibration:
        with open(args.calibration) as f:
            data = json.load(f)
        if "prefill" in data:  # Measurements as JSON (python -m benchmarks.sim_bench measure-cpu)
            measured = Measurements(
                tuple(map(tuple, data["prefill"])), tuple(map(tuple, data["decode"]))
            )
        else:  # pdcluster bench engine --json-out
            lin, lout = (int(x) for x in args.calibration_lengths.split(","))
            measured = Measurements.from_bench_json(data, lin, lout)
        cost = calibrate(cost, measured)
    return cost


def _positive_int(text, flag: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise SystemExit(
            f"error: {flag} must be a positive integer or 'auto', got {text!r}"
        ) from None
    if value < 1:
        raise SystemExit(f"error: {flag} must be a positive integer, got {value}")
    return value


def add_plan_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="how many GPUs: cheapest prefill/decode split meeting the SLOs, vs colocated"
    )
    _add_model_options(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="trace file (CSV/JSONL: arrival_s,input_len,output_len)")
    src.add_argument("--rate", type=float, help="target Poisson rate (req/s)")
    p.add_argument(
        "--input-len",
        default="lognormal:755:0.8",
        help="N, uniform:LO:HI, normal:M:S, exp:M, lognormal:M:S",
    )
    p.add_argument("--output-len", default="lognormal:200:0.8")
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-tpot-ms", type=float, required=True)
    p.add_argument(
        "--percentile", type=float, default=90.0, help="SLO percentile = target attainment"
    )
    p.add_argument("--requests", type=int, default=2000, help="requests per simulated probe")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw attainment against rate here")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_plan)


def run_plan(args) -> int:
    import numpy as np

    from cluster.simulator.report import plot_attainment
    from cluster.simulator.search import PlanSpec, attainment_curve, plan, tp_options
    from cluster.simulator.workload import load_trace

    cost = build_cost_model(args)
    rate, input_len, output_len = args.rate, args.input_len, args.output_len
    if args.trace:
        trace = load_trace(args.trace)
        rate = trace.rate
        # The trace's length mix, resampled: lognormal fitted to its mean and spread.
        input_len = _lognormal_spec(trace.input_len)
        output_len = _lognormal_spec(trace.output_len)
    budget = args.max_batched_tokens or (2048 if cost.hardware.name == "CPU" else 8192)
    spec = PlanSpec(
        cost=cost,
        slo=SLOConfig(
            ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms, percentile=args.percentile
        ),
        input_len=input_len,
        output_len=output_len,
        attainment=args.percentile / 100.0,
        requests=args.requests,
        max_batched_tokens=budget,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        tp_choices=tp_options(cost, cost.hardware.gpus_per_node) if args.tp == "auto" else (),
    )
    disagg, coloc = plan(spec, rate)
    ratio = disagg.goodput_per_gpu / coloc.goodput_per_gpu
    out = {
        "model": cost.model.name,
        "hardware": cost.hardware.name,
        "tp": args.tp if args.tp == "auto" else cost.tp,
        "rate": rate,
        "input_len": input_len,
        "output_len": output_len,
        "disaggregated": _deployment_dict(disagg),
        "colocated": _deployment_dict(coloc),
        "goodput_per_gpu_ratio": ratio,
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(
            f"{cost.model.name} on {cost.hardware.name} "
            f"(tp {'searched per pool' if args.tp == 'auto' else cost.tp}), {rate:g} req/s, input "
            f"{input_len}, output {output_len}, SLO TTFT {args.slo_ttft_ms:g} ms / TPOT "
            f"{args.slo_tpot_ms:g} ms at p{args.percentile:g}"
        )
        print(f"  disaggregated: {disagg.describe()}")
        print(f"  colocated:     {coloc.describe()}")
        print(f"  goodput per GPU, disaggregated / colocated: {ratio:.2f}x")
    if args.plot:
        curves = {}
        for dep in (disagg, coloc):
            rates = list(np.linspace(0.25, 2.0, 8) * max(dep.max_goodput, 1e-3))
            label = f"{dep.mode} ({dep.gpus} GPUs)"
            curves[label] = ([r / dep.gpus for r in rates], attainment_curve(spec, dep, rates))
        plot_attainment(curves, spec.attainment, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _lognormal_spec(values) -> str:
    import numpy as np

    mean = float(np.mean(values))
    sigma = float(np.std(np.log(np.maximum(values, 1))))
    return f"lognormal:{mean:.0f}:{sigma:.2f}" if sigma > 0.01 else f"{int(round(mean))}"


def _deployment_dict(d) -> dict:
    return {
        "prefill": d.prefill,
        "decode": d.decode,
        "colocated": d.colocated,
        "gpus": d.gpus,
        "prefill_tp": d.prefill_tp,
        "decode_tp": d.decode_tp,
        "colocated_tp": d.colocated_tp,
        "max_goodput": d.max_goodput,
        "goodput_per_gpu": d.goodput_per_gpu,
        **d.result.summary(),
    }


def add_simulate_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate", help="replay traffic through the planner: replicas over time, SLOs, GPU-hours"
    )
    p.add_argument("--config", required=True, help="cluster config YAML (pools, slo, planner)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="trace file (CSV/JSONL: arrival_s,input_len,output_len)")
    src.add_argument("--pattern", choices=["poisson", "diurnal", "burst"], help="generated traffic")
    p.add_argument("--rate", type=float, default=10.0, help="mean rate of --pattern (req/s)")
    p.add_argument("--duration", type=float, default=86400.0, help="seconds of --pattern traffic")
    p.add_argument("--input-len", default="lognormal:755:0.8")
    p.add_argument("--output-len", default="lognormal:200:0.8")
    p.add_argument("--startup-s", type=float, default=60.0, help="decision → ready replica")
    p.add_argument("--no-planner", action="store_true", help="fixed pools at their initial size")
    p.add_argument("--plot", default=None, metavar="PNG")
    p.add_argument("--json", action="store_true")
    _add_model_options(p)
    p.set_defaults(func=run_simulate, model=None)


def run_simulate(args) -> int:
    from dataclasses import replace

    from cluster.config import ClusterConfig
    from cluster.simulator.cluster_model import SimConfig
    from cluster.simulator.report import format_simulation, plot_simulation
    from cluster.simulator.simulation import simulate
    from cluster.simulator.workload import generate, load_trace
    from workers.pool import Pool

    cluster = ClusterConfig.from_yaml(args.config)
    args.model = args.model or cluster.model
    if args.hardware is None:
        gpus = max(cluster.prefill.num_gpus, cluster.decode.num_gpus, cluster.colocated.num_gpus)
        args.hardware = "H100" if gpus > 0 else "CPU"

    def pool_tp(pool: Pool) -> int:  # the engine's degree, else one device per GPU it takes
        tp = cluster.engine_config(pool).tensor_parallel_size
        return tp if tp > 1 else max(1, int(getattr(cluster, pool).num_gpus))

    if str(args.tp) == "1":
        args.tp = pool_tp(Pool.COLOCATED if cluster.mode == "colocated" else Pool.PREFILL)
    cost = build_cost_model(args)
    engine = cluster.engine_config("decode")
    planner = cluster.planner if not args.no_planner else replace(cluster.planner, enabled=False)
    config = SimConfig(
        cost=cost,
        slo=cluster.slo,
        mode=cluster.mode,
        prefill=cluster.prefill,
        decode=cluster.decode,
        colocated=cluster.colocated,
        planner=planner,
        max_batched_tokens=args.max_batched_tokens or engine.max_num_batched_tokens,
        max_num_seqs=engine.max_num_seqs,
        kv_tokens=engine.num_kv_blocks * engine.block_size if engine.num_kv_blocks else None,
        startup_s=args.startup_s,
        seed=args.seed,
        prefill_tp=args.prefill_tp or pool_tp(Pool.PREFILL),
        decode_tp=args.decode_tp or pool_tp(Pool.DECODE),
    )
    if args.trace:
        workload = load_trace(args.trace)
    else:
        workload = generate(
            args.pattern, args.rate, args.duration, args.input_len, args.output_len, args.seed
        )
    result = simulate(config, workload)
    if args.json:
        print(
            json.dumps(
                {
                    **result.summary(),
                    "ticks": result.ticks,
                    "decisions": [d.__dict__ for d in result.decisions],
                }
            )
        )
    else:
        print(format_simulation(result))
        for d in result.decisions[:20]:
            print(f"  t={d.time_s:8.0f}s {d.pool} {d.current}→{d.target}: {d.reason}")
        if len(result.decisions) > 20:
            print(f"  … {len(result.decisions) - 20} more scaling actions")
    if args.plot:
        plot_simulation(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m cluster.simulator.cli plan|simulate ...`` (the same as ``pdcluster``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cluster.simulator.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    add_simulate_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
