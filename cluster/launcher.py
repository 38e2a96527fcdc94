"""Starts and stops a pdcluster on Ray: the controller actor, which starts the worker actors
and the router.

Works on a local Ray it starts itself (the default) or on an existing cluster
(``address="auto"``, as after ``ray up`` / ``ray start --head``). Actor names and the Ray
namespace are the contract of ARCHITECTURE.md: ``prefill-<i>``, ``decode-<i>``,
``colocated-<i>``, ``router`` and ``controller`` in namespace ``pdcluster``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.config import ClusterConfig
from cluster.controller import ClusterStartError, Controller

logger = logging.getLogger(__name__)


@dataclass
class RunningCluster:
    config: ClusterConfig
    controller: Any = None
    urls: dict[str, str] = field(default_factory=dict)
    started_ray: bool = False

    def workers(self) -> dict[str, Any]:
        """Worker actor name → handle, as they are now (replicas come and go: one that died
        since the controller listed it is left out)."""
        status = ray.get(self.controller.status.remote())
        names = [r["name"] for replicas in status["pools"].values() for r in replicas]
        handles = {}
        for name in names:
            try:
                handles[name] = ray.get_actor(name, namespace=self.config.namespace)
            except ValueError:
                continue  # killed or crashed; the controller replaces it
        return handles

    def pools(self) -> dict[str, list[str]]:
        status = ray.get(self.controller.status.remote())
        return {pool: [r["name"] for r in replicas] for pool, replicas in status["pools"].items()}


def _requested_cpus(config: ClusterConfig) -> float:
    if config.mode == "colocated":
        return config.colocated.max * config.colocated.num_cpus
    return config.prefill.max * config.prefill.num_cpus + config.decode.max * config.decode.num_cpus


def connect_ray(config: ClusterConfig, address: str | None) -> bool:
    """Join ``address`` or start a local Ray. Returns True if this call connected."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, namespace=config.namespace, log_to_driver=False)
        return True
    cpus = max(os.cpu_count() or 1, int(_requested_cpus(config) + 1))
    # A local cluster talks over loopback only.
    ray.init(
        namespace=config.namespace,
        num_cpus=cpus,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    return True


def start_cluster(
    config: ClusterConfig,
    address: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> RunningCluster:
    """Start the controller on this node (the router goes beside it), wait until every
    initial replica serves, and return. ``progress`` gets a line whenever a replica's state
    or reason changes (pending on a node, loading its model, ready). Raises
    ClusterStartError with the reason when the router cannot bind, a replica fails to
    load, or one is not placed within its pool's ``placement_timeout_s``."""
    if not config.kv.token:
        config = dataclasses.replace(
            config, kv=dataclasses.replace(config.kv, token=secrets.token_urlsafe(24))
        )
    running = RunningCluster(config=config, started_ray=connect_ray(config, address))
    try:
        here = ray.get_runtime_context().get_node_id()
        running.controller = (
            ray.remote(Controller)
            .options(
                name="controller",
                namespace=config.namespace,
                num_cpus=0,
                max_concurrency=100,
                scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
            )
            .remote(config)
        )
        running.urls = _unwrap(lambda: ray.get(running.controller.start.remote()))
        shown: dict[str, str] = {}
        while True:
            started = _unwrap(lambda: ray.get(running.controller.wait_started.remote(2.0)))
            for replica in started["replicas"]:
                line = _progress_line(replica)
                if progress is not None and shown.get(replica["name"]) != line:
                    progress(line)
                shown[replica["name"]] = line
            if started["error"] is not None:
                raise ClusterStartError(started["error"])
            if started["done"]:
                break
        _unwrap(lambda: ray.get(running.controller.serve.remote()))
    except BaseException:
        stop_cluster(running)
        raise
    return running


def _progress_line(replica: dict) -> str:
    state, name = replica["state"], replica["name"]
    if state == "pending":
        return f"{name}: pending, {replica['reason']}"
    where = f" on {replica['node']}" if replica["node"] else ""
    shown = {"starting": "loading its model", "warming": "ready"}.get(state, state)
    return f"{name}: {shown}{where}"


def _unwrap(call: Callable[[], Any]) -> Any:
    """``call()``; a ClusterStartError raised in the controller comes out as itself."""
    try:
        return call()
    except ClusterStartError as err:  # re-raised here by Ray, wrapped
        raise ClusterStartError(str(err.cause if isinstance(err, RayTaskError) else err)) from None


def stop_cluster(running: RunningCluster) -> None:
    """Stop the router and every worker; shut Ray down if this process started it."""
    if running.controller is not None:
        try:
            # The controller's own stop is bounded (router, then every worker side by side);
            # past this the actors are killed anyway.
            ray.get(running.controller.stop.remote(), timeout=8)
        except Exception as err:  # noqa: BLE001 - shutting down regardless
            logger.warning("controller stop: %s", err)
        ray.kill(running.controller)
        running.controller = None
    if running.started_ray:
        ray.shutdown()
