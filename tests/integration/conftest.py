"""One local Ray instance for the whole test session; clusters are started on it in turn."""

from __future__ import annotations

import socket

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(
            namespace="pdcluster",
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
        )
    yield ray
    ray.shutdown()


def GRPC_PORT():  # noqa: N802
    import importlib.util

    return free_port() if importlib.util.find_spec("router.grpc_api") else None


def start(config_dict: dict, attempts: int = 3):
    """Start a cluster from a config dict on the session's Ray, with free ports. A port
    found free can be taken by another process (Ray starts many) before the router binds
    it: then it starts again on fresh ports."""
    from cluster.config import ClusterConfig
    from cluster.launcher import start_cluster

    config_dict = {"model": "tiny", **config_dict}  # the real default model is opted into
    router_overrides = config_dict.pop("router", {})
    for attempt in range(attempts):
        router = {"port": free_port(), "grpc_port": GRPC_PORT(), **router_overrides}
        config = ClusterConfig.from_dict({**config_dict, "router": router})
        try:
            return start_cluster(config)
        except Exception as err:
            message = str(err).lower()
            port_taken = "failed to bind" in message or "address already in use" in message
            if not port_taken or attempt == attempts - 1:
                raise


def stream_and_kill(url: str, prompt: str, max_tokens: int, kill_serving) -> tuple[list[int], str]:
    """Stream a greedy completion of ``prompt``; once 20 tokens have arrived, call
    ``kill_serving()`` until it returns the name of what it killed (what serves the stream),
    and read the stream to its end. Returns every token and that name."""
    import asyncio
    import json

    import httpx

    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "return_token_ids": True,
    }  # fmt: skip

    async def run() -> tuple[list[int], str | None]:
        tokens: list[int] = []
        killed = None
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    for choice in event["choices"]:
                        tokens.extend(choice.get("token_ids") or [])
                    if len(tokens) >= 20 and killed is None:
                        killed = kill_serving()
        return tokens, killed

    tokens, killed = asyncio.run(run())
    assert killed is not None, "the request finished before what served it could be killed"
    return tokens, killed
