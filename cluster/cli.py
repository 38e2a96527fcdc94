"""The ``pdcluster`` command line: serve a cluster, submit to it, generate offline, benchmark."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import EngineError
from engine.named_models import DEFAULT_MODEL, NAMED_MODELS

if TYPE_CHECKING:
    from cluster.config import ClusterConfig

MODEL_HELP = (
    f"a named model ({', '.join(sorted(NAMED_MODELS))}; default {DEFAULT_MODEL}, pulled "
    "when missing), a Hugging Face checkpoint directory, a .gguf file, or 'tiny' (random "
    "weights, for tests)"
)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline with the engine (no cluster)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument(
        "--chat", action="store_true", help="send each prompt as a user message (chat template)"
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (model dtype) or fp8")
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks the model is split over (heads and MLP; processes of this machine)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object per prompt (with token ids)"
    )
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from engine import LLM, SamplingParams
    from engine.tiny import TINY_NAME, TINY_NOTE

    if args.model == TINY_NAME:
        print(f"note: {TINY_NOTE}", file=sys.stderr)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        progress=not args.json,
    )
    prompts = args.prompt
    if args.chat:
        prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in args.prompt]
    with llm:
        outputs = llm.generate(prompts, params)
    for text, output in zip(args.prompt, outputs, strict=True):
        shown = output.prompt if output.prompt is not None else text
        if args.json:
            print(json.dumps({"model": args.model, **output.to_dict()}))
        else:
            print(
                f"{shown!r} -> {output.text!r}  [{len(output.token_ids)} tokens, {output.finish_reason}]"
            )
    return 0


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench", help="benchmarks (each next to a baseline measured in the same run)"
    )
    benches = p.add_subparsers(dest="bench", required=True)
    from benchmarks.engine_bench import add_engine_bench_parser

    add_engine_bench_parser(benches, DEFAULT_MODEL, MODEL_HELP)
    from benchmarks.serve_bench import add_serve_bench_parser

    add_serve_bench_parser(benches)
    from benchmarks.chaos_bench import add_chaos_parser
    from benchmarks.gpu_kernels import add_kernels_parser

    add_chaos_parser(benches)
    from benchmarks.prefix_bench import add_prefix_parser

    add_prefix_parser(benches)
    add_kernels_parser(benches)
    from benchmarks.host_tier_bench import add_host_tier_parser

    add_host_tier_parser(benches)
    try:
        from benchmarks.transfer_bench import add_transfer_parser
    except ImportError:  # pragma: no cover - arrives with the KV transfer benchmark
        pass
    else:
        add_transfer_parser(benches)


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help=f"serve a model on Ray (default: {DEFAULT_MODEL}, 1 prefill + 1 decode actor, local Ray)",
    )
    p.add_argument("--config", help="cluster config YAML (see cluster/configs/)")
    p.add_argument(
        "--address", help="join an existing Ray cluster ('auto' after ray up / ray start)"
    )
    p.add_argument(
        "--mode",
        choices=["disaggregated", "colocated"],
        help="colocated: the baseline, both phases per replica",
    )
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument(
        "--served-model-name",
        help="the name clients use (/v1/models, the 'model' field); default: the model's name "
        "or the checkpoint's base name",
    )
    p.add_argument("--host", help="HTTP host (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, help="gRPC API port (default 50051)")
    p.add_argument("--prefill-replicas", type=int)
    p.add_argument("--decode-replicas", type=int)
    p.add_argument(
        "--kv-transport",
        choices=["grpc", "nixl", "auto"],
        help="how KV moves between the pools: grpc (default), nixl (the nixl extra), or auto "
        "(NIXL where both pools have it)",
    )
    p.add_argument("--kv-wire-dtype", choices=["fp8", "passthrough"], help="gRPC transport only")
    p.add_argument("--kv-cache-dtype", help="auto or fp8")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        help="ranks per replica in every pool (heads and MLP split)",
    )
    p.add_argument("--prefill-tensor-parallel-size", type=int, help="the prefill pool's ranks")
    p.add_argument("--decode-tensor-parallel-size", type=int, help="the decode pool's ranks")
    p.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: PDCLUSTER_API_KEY)"
    )
    p.add_argument("--slo-ttft-ms", type=float, help="TTFT target (default 2000)")
    p.add_argument("--slo-tpot-ms", type=float, help="TPOT target (default 200)")
    p.add_argument(
        "--slo-absolute",
        action="store_true",
        help="hold the SLO targets as absolutes, even where one request alone takes most of "
        "them (default: they are floors, scaled to what the hardware does alone)",
    )
    p.add_argument(
        "--no-slo-admission",
        action="store_true",
        help="admit by the static queue limits only, not by the SLO targets",
    )
    p.set_defaults(func=_run_serve)


def serve_config(args) -> ClusterConfig:
    """The cluster config from --config (or the embedded default) with flags applied."""
    from cluster.config import ClusterConfig

    data: dict = {}
    if args.config:
        import yaml

        data = yaml.safe_load(open(args.config)) or {}
    data.setdefault("router", {})
    data.setdefault("pools", {})
    data.setdefault("kv", {})
    data.setdefault("engine", {})
    if args.model:
        data["model"] = args.model
    if "model" in data and Path(str(data["model"])).exists():
        # Actors resolve the path from their own working directory.
        data["model"] = str(Path(str(data["model"])).resolve())
    if args.mode:
        data["mode"] = args.mode
    for flag, key in (
        ("host", "host"),
        ("port", "port"),
        ("grpc_port", "grpc_port"),
        ("api_key", "api_key"),
        ("served_model_name", "served_model_name"),
    ):
        if getattr(args, flag) is not None:
            data["router"][key] = getattr(args, flag)
    if "api_key" not in data["router"] and os.environ.get("PDCLUSTER_API_KEY"):
        data["router"]["api_key"] = os.environ["PDCLUSTER_API_KEY"]
    for flag, pool in (("prefill_replicas", "prefill"), ("decode_replicas", "decode")):
        if getattr(args, flag) is not None:
            data["pools"].setdefault(pool, {})["replicas"] = getattr(args, flag)
    if args.kv_transport:
        data["kv"]["transport"] = args.kv_transport
    if args.kv_wire_dtype:
        data["kv"]["wire_dtype"] = args.kv_wire_dtype
    if args.kv_cache_dtype:
        data["engine"]["kv_cache_dtype"] = args.kv_cache_dtype
    if args.tensor_parallel_size is not None:
        data["engine"]["tensor_parallel_size"] = args.tensor_parallel_size
    for flag, pool in (
        ("prefill_tensor_parallel_size", "prefill"),
        ("decode_tensor_parallel_size", "decode"),
    ):
        if getattr(args, flag) is not None:
            engine = data["pools"].setdefault(pool, {}).setdefault("engine", {})
            engine["tensor_parallel_size"] = getattr(args, flag)
    for flag, key in (("slo_ttft_ms", "ttft_ms"), ("slo_tpot_ms", "tpot_ms")):
        if getattr(args, flag) is not None:
            data.setdefault("slo", {})[key] = getattr(args, flag)
    if args.slo_absolute:
        data.setdefault("slo", {})["scale_with_hardware"] = False
    if args.no_slo_admission:
        data["router"].setdefault("limits", {})["slo_admission"] = False
    return ClusterConfig.from_dict(data)


def _run_serve(args) -> int:
    import signal
    import threading

    from cluster.ray_env import prepare_ray_environment

    prepare_ray_environment(args.address)
    from cluster.launcher import start_cluster, stop_cluster
    from engine.checkpoint import local_path
    from engine.tiny import TINY_NAME, TINY_NOTE
    from router.actor import check_ports

    config = serve_config(args)
    # The router runs on this node: a port it cannot bind (taken, or not this node's
    # address) is an error now, not after every model has loaded.
    check_ports(dataclasses.asdict(config.router))
    if config.model == TINY_NAME:
        print(f"note: {TINY_NOTE}", file=sys.stderr)
    else:
        local_path(config.model)  # a named model is pulled here, once, before any actor needs it
    print(
        f"starting pdcluster ({config.mode}, model {config.model})...", file=sys.stderr, flush=True
    )

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    # Ctrl-C here stops what started
    running = start_cluster(config, address=args.address, progress=progress)
    import ray

    from cluster.status import clear_state, write_state

    write_state(ray.get_runtime_context().gcs_address, running.urls, config.namespace)
    # Installed after ray.init, which sets its own SIGTERM handler.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        pools = {pool: len(names) for pool, names in running.pools().items() if names}
        print(
            f"pdcluster serving {config.model} at {running.urls['http']} (gRPC {running.urls.get('grpc', 'off')}); "
            f"actors: {pools}; Ctrl-C to stop",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
        print("shutting down...", file=sys.stderr, flush=True)
    finally:
        clear_state()
        stop_cluster(running)
    return 0


def _add_pull(sub) -> None:
    p = sub.add_parser("pull", help="fetch a named model into the model cache")
    p.add_argument("name", choices=sorted(NAMED_MODELS), help="the model's name")
    p.add_argument("--force", action="store_true", help="fetch again even when cached")
    p.set_defaults(func=_run_pull)


def _run_pull(args) -> int:
    from engine.named_models import pull

    print(pull(args.name, force=args.force))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    from cluster.status import add_status_parser
    from router.client import add_submit_parser

    _add_serve(sub)
    _add_pull(sub)
    add_submit_parser(sub)
    add_status_parser(sub)
    from cluster.simulator.cli import add_plan_parser, add_simulate_parser

    add_plan_parser(sub)
    add_simulate_parser(sub)
    _add_generate(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (EngineError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
