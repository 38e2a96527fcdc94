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
            port_taken = "Failed to bind" in str(err) or "address already in use" in str(err)
            if not port_taken or attempt == attempts - 1:
                raise
