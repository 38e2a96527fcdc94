"""Each pool scales on its own SLO, on local Ray with the tiny model (small targets chosen
to fit this machine): a prompt-heavy step grows prefill (not decode) and it shrinks after
the cooldown; a decode-heavy step grows decode. No request fails or is cut throughout."""

from __future__ import annotations

import asyncio
import time

import httpx
import ray

from cluster.launcher import stop_cluster
from tests.integration.conftest import start

PLANNER = {"enabled": True, "interval_s": 1.0, "cooldown_s": 6.0, "max_step": 1, "warmup_s": 2.0}


def pool_sizes(running) -> dict[str, int]:
    pools = ray.get(running.controller.status.remote())["pools"]
    return {
        pool: sum(r["state"] in ("ready", "warming") for r in replicas)
        for pool, replicas in pools.items()
    }


async def load(
    url: str, rate: float, duration_s: float, prompt_len: int, max_tokens: int, sizes: list, running
) -> list[httpx.Response]:
    """Open-loop arrivals at ``rate``/s for ``duration_s``; records pool sizes as it goes."""
    async with httpx.AsyncClient(base_url=url, timeout=180) as client:
        tasks = []
        start_t = time.monotonic()
        i = 0
        while time.monotonic() - start_t < duration_s:
            body = {
                "model": "tiny",
                "prompt": [3 + (i * 7 + j) % 250 for j in range(prompt_len)],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            tasks.append(asyncio.create_task(client.post("/v1/completions", json=body)))
            i += 1
            if i % max(int(rate), 1) == 0:
                sizes.append(await asyncio.to_thread(pool_sizes, running))
            await asyncio.sleep(1.0 / rate)
        return await asyncio.gather(*tasks)


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def start_scaling_cluster(engine: dict, slo: dict):
    """Both pools 1..2 replicas, the planner on, admission limits and SLO-aware shedding out
    of the way (these tests are about scaling, not shedding: the backlog builds rather than
    answer 429)."""
    pool = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1}
    return start(
        {
            "engine": engine,
            "pools": {"prefill": pool, "decode": pool},
            "slo": slo,
            "planner": PLANNER,
            "router": {
                "limits": {
                    "max_prefill_queue_tokens": 10**6,
                    "queue_timeout_s": 90.0,
                    "max_waiting": 1000,
                    "slo_admission": False,
                }
            },
        }
    )


def test_prompt_heavy_step_grows_prefill_then_shrinks(ray_session):
    running = start_scaling_cluster(
        engine={"num_kv_blocks": 4096, "max_num_seqs": 64, "max_num_batched_tokens": 1024},
        slo={"ttft_ms": 250, "tpot_ms": 500, "percentile": 90},
    )
    try:
        sizes: list[dict] = []
        responses = asyncio.run(
            load(
                running.urls["http"],
                rate=24,
                duration_s=12,
                prompt_len=700,
                max_tokens=2,
                sizes=sizes,
                running=running,
            )
        )
        assert all(r.status_code == 200 for r in responses), {r.status_code for r in responses}
        assert all(r.json()["usage"]["completion_tokens"] == 2 for r in responses)
        grown = any(s.get("prefill") == 2 for s in sizes) or pool_sizes(running).get("prefill") == 2
        assert grown, sizes
        assert all(s.get("decode") == 1 for s in sizes), sizes
        # load gone: back to one prefill replica after the cooldown
        assert wait_until(lambda: pool_sizes(running).get("prefill") == 1, timeout_s=40), (
            pool_sizes(running)
        )
        decisions = ray.get(running.controller.status.remote())["decisions"]
        assert decisions and all("reason" in d for d in decisions)
        metrics = httpx.get(running.urls["http"] + "/metrics", timeout=10).text
        assert "pdcluster_planner_target_replicas" in metrics
    finally:
        stop_cluster(running)


def test_decode_heavy_step_grows_decode(ray_session):
    running = start_scaling_cluster(
        engine={"num_kv_blocks": 1024, "max_num_seqs": 8, "max_num_batched_tokens": 512},
        slo={"ttft_ms": 5000, "tpot_ms": 500, "percentile": 90},
    )
    try:
        sizes: list[dict] = []
        responses = asyncio.run(
            load(
                running.urls["http"],
                rate=20,  # ~4,000 tok/s of decode: well past one tiny replica's capacity here
                duration_s=6,
                prompt_len=8,
                max_tokens=200,
                sizes=sizes,
                running=running,
            )
        )
        assert all(r.status_code == 200 for r in responses), {r.status_code for r in responses}
        assert all(r.json()["usage"]["completion_tokens"] == 200 for r in responses)
        final = pool_sizes(running)
        assert any(s.get("decode") == 2 for s in sizes) or final.get("decode") == 2, (sizes, final)
        assert all(s.get("prefill") == 1 for s in sizes), sizes
    finally:
        stop_cluster(running)
