"""Faults and stalls on a live cluster: no request lost, no block leaked. (Overload:
test_overload.py, on a cluster of its own once this module's, whose killed actors the
controller may still be replacing, is gone.)"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray

from cluster.launcher import stop_cluster
from engine import LLM, SamplingParams
from tests.integration.conftest import start, stream_and_kill

# Token-exact against the offline engine, which runs with other threads: one GEMM library.
ENGINE = {
    "num_kv_blocks": 256,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 256,
    "cpu_gemm": "torch",
}


def greedy(prompt: str, max_tokens: int) -> list[int]:
    llm = LLM("tiny", progress=False, **ENGINE)
    return llm.generate(
        [prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )[0].token_ids


def stats_of(running) -> dict[str, dict]:
    return {name: ray.get(h.stats.remote()).to_dict() for name, h in running.workers().items()}


def wait_for(predicate, timeout_s: float = 60.0, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError("condition not reached in time")


def wait_pools_ready(running, prefill: int = 2, decode: int = 2) -> None:
    """Until the controller has replaced every killed replica and all are serving."""

    def ready() -> bool:
        pools = ray.get(running.controller.status.remote())["pools"]
        if not all(
            len(pools.get(pool, [])) == count
            for pool, count in (("prefill", prefill), ("decode", decode))
        ):
            return False
        try:  # every listed actor answers (a killed one may not be noticed yet)
            for pool in ("prefill", "decode"):
                for replica in pools[pool]:
                    ray.get(
                        ray.get_actor(replica["name"], namespace="pdcluster").info.remote(),
                        timeout=5,
                    )
        except Exception:  # noqa: BLE001 - not yet
            return False
        return True

    wait_for(ready, timeout_s=90, interval_s=0.2)


def kill(running, name: str) -> None:
    ray.kill(ray.get_actor(name, namespace="pdcluster"), no_restart=True)


@pytest.fixture(scope="module")
def cluster(ray_session):
    running = start(
        {
            "engine": ENGINE,
            "pools": {
                "prefill": {"replicas": 2, "engine": {"max_num_batched_tokens": 32}},
                "decode": {"replicas": 2},
            },
            "kv": {"wire_dtype": "passthrough", "lease_timeout_s": 3.0},
            "router": {"limits": {"max_attempts": 4}},
        }
    )
    yield running
    stop_cluster(running)


def test_prefill_actor_killed_during_prefill(cluster):
    wait_pools_ready(cluster)
    prompt = (
        "a long prompt that takes many prefill chunks " * 25
    )  # ~1,100 tokens in 32-token chunks
    expected = greedy(prompt, 8)
    result: dict = {}

    def send() -> None:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        result["response"] = httpx.post(
            cluster.urls["http"] + "/v1/completions", json=body, timeout=120
        )

    thread = threading.Thread(target=send)
    thread.start()
    busy = wait_for(
        lambda: [
            n for n, s in stats_of(cluster).items() if n.startswith("prefill") and s["running"]
        ]
    )
    kill(cluster, busy[0])
    thread.join(120)
    response = result["response"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == expected
    # the controller brings the pool back to two prefill replicas
    wait_for(
        lambda: (
            len(cluster.pools().get("prefill", [])) == 2
            and all(
                s.get("alive", True)
                for s in ray.get(cluster.controller.status.remote())["pools"]["prefill"]
            )
        )
    )


def test_decode_actor_killed_mid_stream_migrates_without_gaps(cluster):
    wait_pools_ready(cluster)
    prompt = "migrate this stream"
    expected = greedy(prompt, 300)

    def kill_busy_decode() -> str | None:
        busy = [n for n, s in stats_of(cluster).items() if n.startswith("decode") and s["running"]]
        if busy:
            kill(cluster, busy[0])
            return busy[0]
        return None

    tokens, _ = stream_and_kill(cluster.urls["http"], prompt, 300, kill_busy_decode)
    assert tokens == expected


def test_stalled_transfer_returns_its_blocks(cluster):
    wait_pools_ready(cluster)
    decode = ray.get_actor("decode-0", namespace="pdcluster")
    before = ray.get(decode.stats.remote()).to_dict()
    # A reservation whose prefill never comes (as if the prefill actor stalled).
    ray.get(decode.reserve.remote("stalled#0", list(range(3, 200)), SamplingParams(max_tokens=4)))
    during = ray.get(decode.stats.remote()).to_dict()
    assert (
        during["leases"] == before["leases"] + 1 and during["free_blocks"] < before["free_blocks"]
    )
    after = wait_for(
        lambda: (
            (s := ray.get(decode.stats.remote()).to_dict())["leases"] == before["leases"]
            and s["pending_transfers"] == 0
            and s
        ),
        timeout_s=15,
    )
    assert after["free_blocks"] == before["free_blocks"]


def test_short_chaos_run_loses_nothing(ray_session, cluster):
    from benchmarks.chaos_bench import format_report, run_chaos

    stop_cluster(cluster)  # the chaos run starts its own cluster with the same actor names
    report = run_chaos(
        12.0,
        kill_interval_s=4.0,
        concurrency=4,
        max_tokens=24,
        config_dict={
            "model": "tiny",
            "engine": ENGINE,
            "pools": {"prefill": {"replicas": 2}, "decode": {"replicas": 2}},
            "kv": {"lease_timeout_s": 5.0},
            "router": {
                "port": 0,
                "grpc_port": None,
                "limits": {"max_attempts": 5, "idle_timeout_s": 20.0},
            },
        },
    )
    print(format_report(report))
    assert report.kills and report.sent > 0
    assert report.lost == 0 and report.corrupted_streams == 0 and report.leaked_blocks == 0
    assert report.unread_workers == 0 and report.ok  # and enough of them completed
