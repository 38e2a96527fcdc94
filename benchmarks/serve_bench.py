"""``pdcluster bench serve``: load a running router with open-loop Poisson arrivals and
measure what its users see.

Each request is a streaming ``/v1/completions`` call whose prompt is random token ids (length
drawn from ``--input-len``) asking for ``--output-len`` tokens with ``ignore_eos``. Arrivals
do not wait for responses (open loop), so a slow server builds a queue as real traffic would.
The run stops by itself: no arrivals after ``--duration`` seconds or ``--max-requests``, and
requests still running ``--timeout`` seconds after that are abandoned (counted as failures).

Reports p50/p90/p99 of TTFT (send → first token), TPOT ((last − first token) / (tokens − 1)),
ITL (the gaps between deliveries of tokens) and end-to-end latency, throughput (requests/s,
output tokens/s), goodput (requests/s meeting both SLOs) and failures; and where the time to
first token went, per stage (the router's ``timings_ms``, router/timeline.py), with the
largest named.

Distributions (``--input-len``, ``--output-len``): ``128`` (fixed), ``uniform:64:256``
(inclusive), ``normal:128:32`` (rounded, at least 1).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


def parse_distribution(spec: str) -> Callable[[random.Random], int]:
    """A length sampler from "N", "uniform:LO:HI" or "normal:MEAN:STD" (lengths >= 1)."""
    parts = spec.split(":")
    try:
        if len(parts) == 1:
            n = int(parts[0])
            if n < 1:
                raise ValueError
            return lambda rng: n
        kind, a, b = parts[0], float(parts[1]), float(parts[2])
    except (ValueError, IndexError):
        raise ValueError(
            f"bad length distribution {spec!r}: use N, uniform:LO:HI or normal:MEAN:STD"
        ) from None
    if len(parts) != 3:
        raise ValueError(f"bad length distribution {spec!r}: expected 3 fields")
    if kind == "uniform":
        lo, hi = int(a), int(b)
        if not 1 <= lo <= hi:
            raise ValueError(f"uniform:{lo}:{hi} needs 1 <= LO <= HI")
        return lambda rng: rng.randint(lo, hi)
    if kind == "normal":
        if a < 1 or b < 0:
            raise ValueError(f"normal:{a}:{b} needs MEAN >= 1 and STD >= 0")
        return lambda rng: max(1, round(rng.gauss(a, b)))
    raise ValueError(f"unknown distribution {kind!r}: use uniform or normal")


@dataclass
class RequestResult:
    input_len: int
    output_len: int  # asked for
    start_s: float  # since the run started
    ok: bool = False
    error: str | None = None
    detail: str | None = None  # the server's message for a refused or failed request
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    num_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)  # gaps between token deliveries
    timings_ms: dict[str, float] | None = None  # the router's TTFT stages


@dataclass
class BenchConfig:
    url: str
    rate: float  # requests/s (Poisson)
    duration_s: float
    input_len: str = "128"
    output_len: str = "128"
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    api_key: str | None = None
    max_requests: int = 100_000
    timeout_s: float = 120.0  # per request, and the drain after the last arrival
    vocab: int = 256  # prompt token ids are drawn from [0, vocab)
    seed: int = 0
    model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.duration_s <= 0:
            raise ValueError("--rate and --duration must be positive")
        if self.max_requests < 1 or self.timeout_s <= 0 or self.vocab < 1:
            raise ValueError("--max-requests, --timeout and --vocab must be positive")
        parse_distribution(self.input_len)
        parse_distribution(self.output_len)


def _error_message(body: bytes) -> str:
    """The ``error.message`` of an OpenAI-style error body (else the body's start)."""
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return body[:300].decode("utf-8", "replace")


async def _one(
    client: httpx.AsyncClient, cfg: BenchConfig, prompt: list[int], max_tokens: int, t0: float
) -> RequestResult:
    result = RequestResult(len(prompt), max_tokens, time.perf_counter() - t0)
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,  # count tokens exactly, whatever the text looks like
        "return_timings": True,  # where the time to first token went
    }
    if cfg.model:
        body["model"] = cfg.model
    start = time.perf_counter()
    first = last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                body = await resp.aread()
                result.error = f"HTTP {resp.status_code}"
                result.detail = _error_message(body)
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = "stream error"
                    result.detail = str(chunk["error"])[:300]
                    return result
                if chunk.get("timings_ms"):
                    result.timings_ms = chunk["timings_ms"]
                for choice in chunk.get("choices", []):
                    n = len(choice.get("token_ids") or [])
                    if n:
                        now = time.perf_counter()
                        if last is not None:
                            result.itl_s.append(now - last)
                        last = now
                        first = first or last
                        result.num_tokens += n
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        result.error = type(err).__name__
        return result
    if first is None:
        result.error = "no tokens"
        return result
    result.ok = True
    result.ttft_s = first - start
    result.e2e_s = last - start
    if result.num_tokens > 1:
        result.tpot_s = (last - first) / (result.num_tokens - 1)
    return result


async def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    input_len = parse_distribution(cfg.input_len)
    output_len = parse_distribution(cfg.output_len)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(
        base_url=cfg.url, headers=headers, timeout=cfg.timeout_s, limits=limits
    ) as client:
        max_len = None
        try:
            models = (await client.get("/v1/models")).json()["data"][0]
            max_len = models.get("max_model_len")
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            pass  # not fatal: lengths are then taken as drawn
        tasks: list[asyncio.Task[RequestResult]] = []
        t0 = time.perf_counter()
        next_arrival = 0.0
        while len(tasks) < cfg.max_requests:
            next_arrival += rng.expovariate(cfg.rate)
            if next_arrival >= cfg.duration_s:
                break
            n_in, n_out = input_len(rng), output_len(rng)
            if max_len:  # keep every request servable, so failures mean the server failed
                n_in = min(n_in, max_len - 1)
                n_out = min(n_out, max_len - n_in)
            prompt = [rng.randrange(cfg.vocab) for _ in range(n_in)]
            await asyncio.sleep(max(0.0, next_arrival - (time.perf_counter() - t0)))
            tasks.append(asyncio.create_task(_one(client, cfg, prompt, n_out, t0)))
        arrivals_s = time.perf_counter() - t0
        done, pending = (
            await asyncio.wait(tasks, timeout=cfg.timeout_s) if tasks else (set(), set())
        )
        for task in pending:
            task.cancel()
        results = [t.result() for t in tasks if t in done]
        results += [RequestResult(0, 0, 0.0, error="timeout") for _ in pending]
        elapsed = time.perf_counter() - t0
    return {
        "config": asdict(cfg),
        "summary": summarize(results, elapsed, arrivals_s, cfg),
        "requests": [asdict(r) for r in results],
    }


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    values = sorted(values)

    def pct(p: float) -> float:  # nearest rank
        return values[min(len(values) - 1, max(0, math.ceil(p / 100 * len(values)) - 1))]

    return {"p50": pct(50), "p90": pct(90), "p99": pct(99), "mean": sum(values) / len(values)}


def summarize(
    results: list[RequestResult], elapsed_s: float, arrivals_s: float, cfg: BenchConfig
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]

    def meets_slo(r: RequestResult) -> bool:
        if cfg.slo_ttft_ms is not None and r.ttft_s * 1e3 > cfg.slo_ttft_ms:
            return False
        tpot = r.tpot_s or 0.0
        return cfg.slo_tpot_ms is None or tpot * 1e3 <= cfg.slo_tpot_ms

    ms = lambda xs: [x * 1e3 for x in xs if x is not None]
    stages: dict[str, list[float]] = {}
    for r in ok:
        for stage, value in (r.timings_ms or {}).items():
            stages.setdefault(stage, []).append(value)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures": dict(Counter(r.error for r in results if not r.ok)),
        "elapsed_s": elapsed_s,
        "arrival_window_s": arrivals_s,
        "request_throughput": len(ok) / elapsed_s,
        "output_token_throughput": sum(r.num_tokens for r in ok) / elapsed_s,
        "goodput": sum(meets_slo(r) for r in ok) / elapsed_s,
        "ttft_ms": _percentiles(ms(r.ttft_s for r in ok)),
        "tpot_ms": _percentiles(ms(r.tpot_s for r in ok)),
        "e2e_ms": _percentiles(ms(r.e2e_s for r in ok)),
        "itl_ms": _percentiles(ms(gap for r in ok for gap in r.itl_s)),
        "ttft_stages_ms": {stage: _percentiles(values) for stage, values in stages.items()},
    }


def format_summary(summary: dict[str, Any]) -> str:
    def row(name: str, d: dict) -> str:
        cells = [f"{d[k]:9.1f}" if d[k] is not None else f"{'-':>9}" for k in ("p50", "p90", "p99")]
        return f"{name:<10}" + "".join(cells)

    lines = [
        f"requests: {summary['completed']} ok, {summary['failed']} failed "
        f"{summary['failures'] or ''} in {summary['elapsed_s']:.1f} s",
        f"throughput: {summary['request_throughput']:.2f} req/s, "
        f"{summary['output_token_throughput']:.1f} output tok/s; "
        f"goodput: {summary['goodput']:.2f} req/s",
        f"{'ms':<10}{'p50':>9}{'p90':>9}{'p99':>9}",
        row("TTFT", summary["ttft_ms"]),
        row("TPOT", summary["tpot_ms"]),
        row("ITL", summary["itl_ms"]),
        row("e2e", summary["e2e_ms"]),
    ]
    stages = summary.get("ttft_stages_ms") or {}
    if stages:
        lines.append("TTFT by stage, ms (p50 / mean):")
        for stage, d in stages.items():
            lines.append(f"  {stage:<15}{d['p50']:9.1f}{d['mean']:9.1f}")
        largest = max(stages, key=lambda s: stages[s]["mean"] or 0.0)
        lines.append(f"largest: {largest} ({stages[largest]['mean']:.1f} ms mean)")
    return "\n".join(lines)


def plot_cdfs(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib  # lazily: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in zip(
        axes, ("ttft_s", "tpot_s", "e2e_s"), ("TTFT", "TPOT", "end-to-end"), strict=True
    ):
        values = sorted(r[key] * 1e3 for r in results if r["ok"] and r[key] is not None)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))])
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- pdcluster bench serve -----------------------------------------------------------------


def add_serve_bench_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "serve", help="open-loop Poisson load on a running router: TTFT/TPOT, goodput"
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router's base URL")
    p.add_argument("--rate", type=float, required=True, help="arrivals per second (Poisson)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--input-len", default="128", help="N, uniform:LO:HI or normal:MEAN:STD")
    p.add_argument("--output-len", default="128", help="N, uniform:LO:HI or normal:MEAN:STD")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--vocab", type=int, default=256, help="prompt ids are drawn from [0, VOCAB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--json-out", default=None, help="write summary and per-request data here")
    p.add_argument("--plot", default=None, help="draw latency CDFs into this .png")
    p.set_defaults(func=run_serve_bench)


def run_serve_bench(args) -> int:
    cfg = BenchConfig(
        url=args.url,
        rate=args.rate,
        duration_s=args.duration,
        input_len=args.input_len,
        output_len=args.output_len,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        api_key=args.api_key,
        max_requests=args.max_requests,
        timeout_s=args.timeout,
        vocab=args.vocab,
        seed=args.seed,
        model=args.model,
    )
    out = asyncio.run(run_benchmark(cfg))
    print(format_summary(out["summary"]))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json_out}", file=sys.stderr)
    if args.plot:
        plot_cdfs(out["requests"], args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if out["summary"]["completed"] else 1
