"""``pdcluster bench chaos --duration S``: load a cluster while killing random prefill and
decode actors, and count what users would lose.

Starts its own local cluster (2 prefill + 2 decode actors of the default model by default,
``--model`` or ``--config`` for others), sends a steady stream of greedy streaming requests
whose exact token sequence is known in advance (from the offline engine), and every
``--kill-interval`` seconds kills a random worker actor with Ray's ``ray.kill`` (no
restart: the controller must replace it). Its clients (``--concurrency``, one request at a
time each) do what clients of a 429 do: wait its Retry-After before the next request.
Afterwards it waits for the cluster to go idle and prints:

- sent, completed, failed with a clear error (an error event or status), lost (no answer by
  the deadline, or a broken connection without an error) — lost must be 0;
- streams with duplicated or missing tokens (completed streams whose tokens differ from the
  offline run) — must be 0;
- KV blocks leaked on any actor after the run — must be 0, every actor's blocks read.

A run passes only if those hold *and* at least ``--min-completed`` of the requests sent
completed (a cluster that answers every request with an error loses nothing, but serves
nothing either).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

PROMPTS = [
    "The history of distributed systems is",
    "In a disaggregated serving cluster, prefill and decode",
    "Once upon a time " * 6,
    "KV cache blocks move between actors " * 3,
    "a",
    "0123456789 " * 10,
]


@dataclass
class ChaosReport:
    duration_s: float
    sent: int = 0
    completed: int = 0
    failed_clear: int = 0
    lost: int = 0
    corrupted_streams: int = 0  # duplicated or missing tokens
    leaked_blocks: int = 0
    unread_workers: int = 0  # actors whose blocks could not be read at the end
    kills: list[str] = field(default_factory=list)
    replacements_seen: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    min_completed: float = 0.5  # the share of sent requests that must complete

    @property
    def ok(self) -> bool:
        return (
            self.sent > 0
            and self.completed >= self.min_completed * self.sent
            and self.lost == 0
            and self.corrupted_streams == 0
            and self.leaked_blocks == 0
            and self.unread_workers == 0
        )


async def _one(
    client: httpx.AsyncClient,
    prompt: str,
    max_tokens: int,
    expected: list[int],
    report: ChaosReport,
    deadline: float,
) -> None:
    body = {
        "prompt": prompt,  # no "model": whatever the cluster serves
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    tokens: list[int] = []
    report.sent += 1
    try:
        async with asyncio.timeout(max(deadline - time.monotonic(), 1.0)):
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    report.failed_clear += 1
                    await response.aread()
                    reason = _error_message(response)
                    key = f"http {response.status_code}" + (f" ({reason})" if reason else "")
                    report.errors[key] = report.errors.get(key, 0) + 1
                    if response.status_code == 429:  # as clients do: come back when told
                        retry_after = float(response.headers.get("retry-after", 1.0))
                        await asyncio.sleep(min(retry_after, max(0.0, deadline - time.monotonic())))
                    return
                finish, error = None, None
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"].get("message", "error")
                        continue
                    for choice in event.get("choices", []):
                        tokens.extend(choice.get("token_ids") or [])
                        finish = choice.get("finish_reason") or finish
        if error is not None:
            report.failed_clear += 1
            report.errors[error[:80]] = report.errors.get(error[:80], 0) + 1
        elif finish is None:
            report.lost += 1  # the stream ended without a finish and without an error
        else:
            report.completed += 1
            if tokens != expected:
                report.corrupted_streams += 1
    except (TimeoutError, httpx.HTTPError) as err:
        report.lost += 1
        key = type(err).__name__
        report.errors[key] = report.errors.get(key, 0) + 1


def _error_message(response: httpx.Response) -> str:
    """The first words of an error response's message (what kind of refusal it was)."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    return " ".join(message.split()[:5])


async def _load(
    url: str,
    duration_s: float,
    concurrency: int,
    max_tokens: int,
    expected: dict[str, list[int]],
    report: ChaosReport,
) -> None:
    deadline = time.monotonic() + duration_s
    answer_deadline = deadline + 120.0
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0)) as client:

        async def worker() -> None:
            while time.monotonic() < deadline:
                prompt = rng.choice(PROMPTS)
                await _one(client, prompt, max_tokens, expected[prompt], report, answer_deadline)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _killer(
    running, duration_s: float, interval_s: float, report: ChaosReport, seed: int
) -> None:
    import ray

    rng = random.Random(seed)
    deadline = time.monotonic() + duration_s
    await asyncio.sleep(interval_s)
    while time.monotonic() < deadline - interval_s / 2:
        names = [
            n
            for n in await asyncio.to_thread(lambda: list(running.workers()))
            if n.split("-")[0] in ("prefill", "decode")
        ]
        if names:
            victim = rng.choice(names)
            try:
                ray.kill(ray.get_actor(victim, namespace=running.config.namespace), no_restart=True)
                report.kills.append(victim)
            except ValueError:
                pass  # already gone (being replaced)
        await asyncio.sleep(interval_s)


def _leaked_blocks(running, timeout_s: float = 60.0) -> tuple[int, int]:
    """(KV blocks still held, actors whose stats could not be read) once the cluster is
    idle; waits up to ``timeout_s`` for both to reach 0."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        listed = [name for names in running.pools().values() for name in names]
        handles = running.workers()
        leaked, unread = 0, len(set(listed) - set(handles))  # listed, but not there (yet)
        for handle in handles.values():
            try:
                stats = ray.get(handle.stats.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a replacement still loading: look again
                unread += 1
                continue
            # Every worker reports its blocks (cached prefixes count as free: evictable).
            leases = stats.decode.leases if stats.decode is not None else 0
            leaked += stats.load.num_blocks - stats.load.free_blocks + leases
        if (leaked == 0 and unread == 0) or time.monotonic() > deadline:
            return leaked, unread
        time.sleep(0.5)


def run_chaos(
    duration_s: float,
    *,
    kill_interval_s: float = 4.0,
    concurrency: int = 6,
    max_tokens: int = 48,
    config_dict: dict | None = None,
    seed: int = 0,
    model: str | None = None,
    min_completed: float = 0.5,
    kv_transport: str | None = None,
) -> ChaosReport:
    """Start a cluster, run the load with kills, stop the cluster; return the report."""
    from cluster.config import ClusterConfig
    from cluster.launcher import start_cluster, stop_cluster
    from engine import LLM, SamplingParams

    data = config_dict or {
        # One GEMM library: the offline reference runs with other threads than the actors.
        # fp32: a stream moved after a kill resumes from a recomputed prefill, which in bf16
        # may round its later tokens another way (README, "CPU dtype"); in fp32 it must not.
        "engine": {
            "num_kv_blocks": 256,
            "max_num_seqs": 32,
            "max_num_batched_tokens": 512,
            "cpu_gemm": "torch",
            "dtype": "float32",
        },
        "pools": {"prefill": {"replicas": 2}, "decode": {"replicas": 2}},
        "kv": {
            "lease_timeout_s": 5.0,
            "wire_dtype": "passthrough",
        },  # exact: streams compare token for token
        "router": {
            "port": 0,
            "grpc_port": None,
            "limits": {"max_attempts": 5, "idle_timeout_s": 20.0},
        },
    }
    # Streams are compared token for token with the offline engine: KV must travel exactly.
    data = {**data, "kv": {**data.get("kv", {}), "wire_dtype": "passthrough"}}
    if kv_transport is not None:
        data["kv"]["transport"] = kv_transport
    if model is not None:
        data["model"] = model
    config = ClusterConfig.from_dict(data)
    engine_options = {k: v for k, v in config.engine.items()}
    llm = LLM(config.model, progress=False, **engine_options)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    expected = {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True)}
    del llm
    report = ChaosReport(duration_s=duration_s, min_completed=min_completed)
    running = start_cluster(config)
    try:

        async def main() -> None:
            await asyncio.gather(
                _load(running.urls["http"], duration_s, concurrency, max_tokens, expected, report),
                _killer(running, duration_s, kill_interval_s, report, seed),
            )

        asyncio.run(main())
        report.leaked_blocks, report.unread_workers = _leaked_blocks(running)
        import ray

        status = ray.get(running.controller.status.remote())
        report.replacements_seen = sum(1 for e in status["events"] if e["kind"] == "replace")
    finally:
        stop_cluster(running)
    return report


def format_report(report: ChaosReport) -> str:
    lines = [
        f"chaos run: {report.duration_s:.0f}s, {len(report.kills)} actors killed ({', '.join(report.kills) or 'none'}),"
        f" {report.replacements_seen} replaced by the controller",
        f"  sent {report.sent}  completed {report.completed}  failed with a clear error {report.failed_clear}",
        f"  lost {report.lost} (must be 0)  duplicated/missing-token streams {report.corrupted_streams} (must be 0)"
        f"  leaked KV blocks {report.leaked_blocks} (must be 0)"
        f"  actors unread {report.unread_workers} (must be 0)",
        f"  completed {report.completed / max(report.sent, 1):.0%} of sent "
        f"(must be at least {report.min_completed:.0%})",
    ]
    if report.errors:
        lines.append(
            "  errors: " + "; ".join(f"{k} x{v}" for k, v in sorted(report.errors.items()))
        )
    lines.append("  RESULT: " + ("PASS" if report.ok else "FAIL"))
    return "\n".join(lines)


def add_chaos_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "chaos", help="load a local cluster while killing actors; count lost requests"
    )
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load (default 30)")
    p.add_argument(
        "--kill-interval", type=float, default=4.0, help="seconds between kills (default 4)"
    )
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--model", default=None, help="model to serve (default: the default model)")
    p.add_argument(
        "--min-completed",
        type=float,
        default=0.5,
        help="share of sent requests that must complete for a pass (default 0.5)",
    )
    p.add_argument("--config", help="cluster config YAML (default: 2 prefill + 2 decode actors)")
    p.add_argument("--kv-transport", choices=["grpc", "nixl"], help="how KV moves (default grpc)")
    p.add_argument("--json-out", help="also write the report as JSON")
    p.set_defaults(func=run_chaos_cli)


def run_chaos_cli(args) -> int:
    from cluster.ray_env import prepare_ray_environment

    prepare_ray_environment(None)
    config_dict = None
    if args.config:
        import yaml

        config_dict = yaml.safe_load(open(args.config)) or {}
        config_dict.setdefault("router", {}).update({"port": 0, "grpc_port": None})
    report = run_chaos(
        args.duration,
        kill_interval_s=args.kill_interval,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        config_dict=config_dict,
        model=args.model,
        min_completed=args.min_completed,
        kv_transport=args.kv_transport,
    )
    print(format_report(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**asdict(report), "ok": report.ok}, f, indent=2)
    return 0 if report.ok else 1
