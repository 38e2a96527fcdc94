"""Tensor parallelism through the cluster (colocated replicas of tp 2, CPU, shared memory
between the ranks): the offline engine's greedy tokens; a rank killed mid-stream ends its
replica, the stream finishes on the other one without gaps, and the replica is replaced;
configs that cannot run are refused at start-up with the reason."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import ray

from cluster.config import ClusterConfig, ConfigError
from cluster.launcher import stop_cluster
from engine import LLM, SamplingParams
from tests.integration.conftest import start, stream_and_kill

ENGINE = {
    "num_kv_blocks": 256,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 256,
    "cpu_gemm": "torch",
    "tensor_parallel_size": 2,
}


def greedy(prompt: str, max_tokens: int) -> list[int]:
    with LLM("tiny", progress=False, **{**ENGINE, "tensor_parallel_size": 1}) as llm:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return llm.generate([prompt], params)[0].token_ids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def colocated_ready(running, count: int, timeout_s: float = 120.0) -> dict:
    """Until ``count`` colocated replicas answer; their info by name."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = running.workers()
        try:
            infos = {n: ray.get(h.info.remote(), timeout=10) for n, h in workers.items()}
        except ray.exceptions.RayActorError:
            infos = {}
        if len(infos) == count:
            return infos
        time.sleep(0.2)
    raise AssertionError("the colocated replicas did not come back")


@pytest.fixture(scope="module")
def cluster(ray_session):
    running = start(
        {"mode": "colocated", "engine": ENGINE, "pools": {"colocated": {"replicas": 2}}}
    )
    yield running
    stop_cluster(running)


def test_tp2_replicas_serve_the_offline_tokens(cluster):
    infos = colocated_ready(cluster, 2)
    assert all(info["tensor_parallel"]["size"] == 2 for info in infos.values())
    prompt = "tensor parallel " * 12
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    response = httpx.post(cluster.urls["http"] + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == greedy(prompt, 16)


def test_a_killed_rank_ends_its_replica_and_the_stream_moves_on(cluster):
    infos = colocated_ready(cluster, 2)
    prompt = "a rank dies mid-stream"
    expected = greedy(prompt, 200)

    def kill_a_serving_rank() -> str | None:
        for name, handle in cluster.workers().items():
            if ray.get(handle.stats.remote()).to_dict()["running"]:
                os.kill(infos[name]["tensor_parallel"]["rank_pids"][1], signal.SIGKILL)
                return name
        return None

    tokens, victim = stream_and_kill(cluster.urls["http"], prompt, 200, kill_a_serving_rank)
    assert tokens == expected
    actor_pid = infos[victim]["tensor_parallel"]["rank_pids"][0]
    deadline = time.monotonic() + 30
    while _alive(actor_pid) and time.monotonic() < deadline:  # the replica goes as one unit
        time.sleep(0.1)
    assert not _alive(actor_pid)
    replaced = colocated_ready(cluster, 2)
    assert all(info["tensor_parallel"]["size"] == 2 for info in replaced.values())


def test_configs_that_cannot_run_are_refused():
    with pytest.raises(ConfigError, match="moves the KV of tp 1 replicas only") as refused:
        ClusterConfig.from_dict(
            {"model": "tiny", "kv": {"transport": "nixl"},
             "pools": {"decode": {"engine": {"tensor_parallel_size": 2}}}}
        )  # fmt: skip
    assert "pools.decode" in str(refused.value)
    with pytest.raises(ConfigError, match="takes 2 GPUs"):
        ClusterConfig.from_dict(
            {"model": "tiny", "mode": "colocated", "engine": {"tensor_parallel_size": 2},
             "pools": {"colocated": {"num_gpus": 1}}}
        )  # fmt: skip
