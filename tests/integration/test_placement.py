"""Placement on the test session's local Ray (4 CPUs): a replica that cannot be placed is
pending with its reason, in status and /metrics, while the cluster serves and a dead
replica is still replaced; past its deadline it is given up and planned again; scale-down
cancels it. At start-up, a pool that can never be placed ends start-up with the reason, and
a router port that is taken ends it with the bind error."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
import ray

from cluster.controller import ClusterStartError
from cluster.launcher import start_cluster, stop_cluster
from tests.integration.conftest import free_port, start

ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 8, "max_num_batched_tokens": 128}


def pools(running) -> dict[str, list[dict]]:
    return ray.get(running.controller.status.remote())["pools"]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def completion(url: str, prompt: str) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_replica_that_cannot_be_placed_waits_while_the_cluster_serves(ray_session):
    # 4 CPUs: prefill 1 + decode 2 leave 1, and a second decode replica needs 2.
    running = start(
        {
            "engine": ENGINE,
            "pools": {
                "prefill": {"replicas": 1, "num_cpus": 1},
                "decode": {
                    "min_replicas": 1,
                    "initial_replicas": 1,
                    "max_replicas": 2,
                    "num_cpus": 2,
                    "placement_timeout_s": 12,
                },
            },
        }
    )
    url = running.urls["http"]
    try:
        assert ray.get(running.controller.scale.remote("decode", 2)) == ["decode-0", "decode-1"]

        def pending() -> dict | None:
            return next((r for r in pools(running)["decode"] if r["state"] == "pending"), None)

        replica = wait_for(
            lambda: (r := pending()) and "waiting for" in r["reason"] and r, 10, "a reason"
        )
        assert replica["name"] == "decode-1"
        assert "2 CPU free on one node" in replica["reason"], replica["reason"]
        wait_for(
            lambda: (
                'pdcluster_replicas{pool="decode",state="pending"} 1.0'
                in httpx.get(f"{url}/metrics", timeout=10).text
            ),
            10,
            "the pending replica in /metrics",
        )
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'pdcluster_replica_pending_seconds{pool="decode",replica="decode-1"}' in metrics

        # The rest serves, and a replica that dies meanwhile is replaced.
        completion(url, "served while decode-1 waits")
        ray.kill(ray.get_actor("prefill-0", namespace="pdcluster"), no_restart=True)
        wait_for(
            lambda: any(
                e["message"].startswith("prefill-0 on") and "died" in e["message"]
                for e in ray.get(running.controller.status.remote())["events"]
            ),
            20,
            "prefill-0's death to be seen",
        )
        assert pending() is not None  # still waiting, while prefill-0 is replaced
        wait_for(
            lambda: (
                [r["state"] for r in pools(running)["prefill"]] == ["warming"]
                or [r["state"] for r in pools(running)["prefill"]] == ["ready"]
            ),
            60,
            "prefill-0's replacement",
        )
        completion(url, "served by the replacement")

        # Past its deadline it is given up, then planned again (the target is still 2).
        events = wait_for(
            lambda: [
                e["message"]
                for e in ray.get(running.controller.status.remote())["events"]
                if "given up" in e["message"]
            ],
            20,
            "the deadline",
        )
        assert events[0].startswith("decode-1 was not placed in 12 s"), events
        wait_for(pending, 10, "decode-1 planned again")

        # Scale-down cancels it: nothing to drain.
        assert ray.get(running.controller.scale.remote("decode", 1)) == ["decode-0"]
        assert pending() is None
        completion(url, "served after scale-down")
        with pytest.raises(ray.exceptions.RayTaskError, match=r"outside \[1, 2\]"):
            ray.get(running.controller.scale.remote("decode", 3))
    finally:
        stop_cluster(running)


def test_a_pool_that_can_never_be_placed_ends_start_up_with_the_reason(ray_session):
    lines: list[str] = []
    config = {
        "engine": ENGINE,
        "pools": {
            "prefill": {"replicas": 1, "num_cpus": 0.5},
            "decode": {
                "replicas": 1,
                "num_cpus": 0.5,
                "resources": {"accelerator_type:H100": 0.001},
                "placement_timeout_s": 5,
            },
        },
        "router": {"port": free_port(), "grpc_port": None},
    }
    from cluster.config import ClusterConfig

    started = time.monotonic()
    with pytest.raises(ClusterStartError) as refused:
        start_cluster(ClusterConfig.from_dict({"model": "tiny", **config}), progress=lines.append)
    assert time.monotonic() - started < 30
    message = str(refused.value)
    assert message.startswith("decode-0 was not placed in 5 s"), message
    assert "no node of the cluster has that much" in message, message
    assert any(line.startswith("decode-0: pending, waiting for") for line in lines), lines
    assert any(line.startswith("prefill-0: ") for line in lines), lines
    with pytest.raises(ValueError):  # nothing left behind: the names are free again
        ray.get_actor("router", namespace="pdcluster")


def test_a_router_port_that_is_taken_ends_start_up_with_the_bind_error(ray_session):
    from cluster.config import ClusterConfig

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = ClusterConfig.from_dict(
            {"model": "tiny", "engine": ENGINE, "router": {"port": port, "grpc_port": None}}
        )
        started = time.monotonic()
        with pytest.raises(
            ClusterStartError, match=f"cannot bind the HTTP API to 127.0.0.1:{port}"
        ):
            start_cluster(config)
        assert time.monotonic() - started < 10
