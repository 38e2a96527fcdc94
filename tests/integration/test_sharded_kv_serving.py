"""Disaggregated pools of different tensor-parallel degrees (CPU, tiny: 2 KV heads): prefill
tp 2 → decode tp 1 and prefill tp 1 → decode tp 2, each rank sending or receiving its own KV
heads. Greedy streams equal the offline engine's and every block is free afterwards; a
decode rank killed mid-stream ends its replica, the stream finishes exactly on the other
one, and the replica is replaced; layouts that cannot meet are refused at start-up."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import ray

from cluster.controller import ClusterStartError
from cluster.launcher import stop_cluster
from tests.integration.conftest import start, stream_and_kill
from tests.integration.test_cluster import wait_idle
from tests.integration.test_tensor_parallel_serving import ENGINE, greedy

BASE = {key: value for key, value in ENGINE.items() if key != "tensor_parallel_size"}
PROMPTS = ["sharded KV " * 9, "Hello, world", "x" * 70]


def pools(prefill_tp: int, decode_tp: int, decode_replicas: int = 1) -> dict:
    return {
        "mode": "disaggregated",
        "engine": BASE,
        "kv": {"wire_dtype": "passthrough"},
        "pools": {
            "prefill": {"replicas": 1, "engine": {"tensor_parallel_size": prefill_tp}},
            "decode": {
                "replicas": decode_replicas,
                "engine": {"tensor_parallel_size": decode_tp},
            },
        },
    }


def complete(url: str, prompt: str, max_tokens: int) -> list[int]:
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def assert_all_blocks_free(cluster) -> None:
    stats = wait_idle(cluster)
    for name, s in stats.items():
        if name.startswith("decode"):
            assert s["free_blocks"] == s["num_blocks"] and s["leases"] == 0, (name, s)
        else:
            assert s["kv_usage"] == 0 and s["running"] == 0, (name, s)


@pytest.fixture(scope="module")
def expected():
    return {prompt: greedy(prompt, 12) for prompt in PROMPTS}


def test_prefill_tp2_into_decode_tp1(ray_session, expected):
    cluster = start(pools(2, 1))
    try:
        infos = {n: ray.get(h.info.remote()) for n, h in cluster.workers().items()}
        assert infos["prefill-0"]["tensor_parallel"]["kv_heads"] == [[0, 1], [1, 2]]
        for prompt in PROMPTS:
            assert complete(cluster.urls["http"], prompt, 12) == expected[prompt], prompt
        assert_all_blocks_free(cluster)
        # A rank lost while its replica is idle ends the replica too (not at its next step).
        os.kill(infos["prefill-0"]["tensor_parallel"]["rank_pids"][1], signal.SIGKILL)
        replaced = wait_replaced(cluster, "prefill", infos["prefill-0"], count=1)
        assert all(info["tensor_parallel"]["size"] == 2 for info in replaced.values())
        assert complete(cluster.urls["http"], PROMPTS[0], 12) == expected[PROMPTS[0]]
    finally:
        stop_cluster(cluster)


def wait_replaced(cluster, pool: str, old_info: dict, count: int) -> dict:
    """The pool's replicas' info once ``count`` answer and none is the old actor's process."""
    old_pid = old_info["tensor_parallel"]["rank_pids"][0]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        handles = {n: h for n, h in cluster.workers().items() if n.startswith(pool)}
        try:
            now = {n: ray.get(h.info.remote(), timeout=10) for n, h in handles.items()}
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            now = {}  # the old actor is ending, or the new one still loading
        pids = [info["tensor_parallel"]["rank_pids"][0] for info in now.values()]
        if len(now) == count and old_pid not in pids:
            return now
        time.sleep(0.2)
    raise AssertionError(f"the {pool} replica was not replaced")


def test_layouts_that_cannot_meet_are_refused_at_start_up(ray_session):
    config = pools(1, 2)
    config["pools"]["decode"]["engine"]["block_size"] = 32
    with pytest.raises(ClusterStartError) as refused:
        start(config)
    message = str(refused.value)
    assert "prefill-0 (tp 1" in message and "decode-0 (tp 2" in message, message
    assert "block sizes differ" in message


@pytest.fixture(scope="module")
def into_tp2(ray_session):
    cluster = start(pools(1, 2, decode_replicas=2))
    yield cluster
    stop_cluster(cluster)


def test_prefill_tp1_into_decode_tp2(into_tp2, expected):
    for prompt in PROMPTS:
        assert complete(into_tp2.urls["http"], prompt, 12) == expected[prompt], prompt
    assert_all_blocks_free(into_tp2)


def test_a_killed_decode_rank_moves_its_stream_and_the_replica_is_replaced(into_tp2):
    cluster = into_tp2
    infos = {n: ray.get(h.info.remote()) for n, h in cluster.workers().items()}
    prompt = "a decode rank dies mid-stream"
    expected_tokens = greedy(prompt, 200)

    def kill_a_serving_rank() -> str | None:
        for name, handle in cluster.workers().items():
            if name.startswith("decode") and ray.get(handle.stats.remote()).to_dict()["running"]:
                os.kill(infos[name]["tensor_parallel"]["rank_pids"][1], signal.SIGKILL)
                return name
        return None

    tokens, victim = stream_and_kill(cluster.urls["http"], prompt, 200, kill_a_serving_rank)
    assert tokens == expected_tokens
    now = wait_replaced(cluster, "decode", infos[victim], count=2)
    assert all(info["tensor_parallel"]["size"] == 2 for info in now.values())
    assert complete(cluster.urls["http"], PROMPTS[0], 12) == greedy(PROMPTS[0], 12)
    assert_all_blocks_free(cluster)
