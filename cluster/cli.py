"""The ``pdcluster`` command line.

Subcommands available so far: ``generate`` (offline generation with the engine) and
``bench engine``. The serving commands (serve, submit, status, plan) arrive with the cluster.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.errors import EngineError


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline with the engine (no cluster)")
    p.add_argument("--model", default="tiny", help="checkpoint directory or 'tiny' (default)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
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
        progress=not args.json,
    )
    for output in llm.generate(args.prompt, params):
        if args.json:
            print(json.dumps({"model": args.model, **output.to_dict()}))
        else:
            print(
                f"{output.prompt!r} -> {output.text!r}  [{len(output.token_ids)} tokens, {output.finish_reason}]"
            )
    return 0


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench", help="benchmarks (each next to a baseline measured in the same run)"
    )
    benches = p.add_subparsers(dest="bench", required=True)
    engine = benches.add_parser("engine", help="prefill and decode tokens/s vs transformers")
    engine.add_argument("--model", default="tiny")
    engine.add_argument("--concurrency", default="1,8,32", help="comma-separated sequence counts")
    engine.add_argument("--prompt-len", type=int, default=128)
    engine.add_argument("--output-len", type=int, default=64)
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--kv-cache-dtype", default="auto")
    engine.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    engine.add_argument("--json-out", default=None, help="also write the results as JSON here")
    engine.set_defaults(func=_run_bench_engine)


def _run_bench_engine(args) -> int:
    from benchmarks.engine_bench import run_engine_benchmark

    return run_engine_benchmark(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EngineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
