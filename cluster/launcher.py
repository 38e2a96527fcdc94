"""Starts and stops a pdcluster on Ray: worker actors per pool, then the router.

Works on a local Ray it starts itself (the default) or on an existing cluster
(``address="auto"``, as after ``ray up`` / ``ray start --head``). Actor names and the Ray
namespace are the contract of ARCHITECTURE.md: ``prefill-<i>``, ``decode-<i>``,
``colocated-<i>``, ``router`` in namespace ``pdcluster``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.config import ClusterConfig
from decode_worker.colocated import ColocatedWorker
from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker
from router.actor import RouterActor

logger = logging.getLogger(__name__)

# Prefill calls block a thread each while their prompt waits in the engine's queue.
PREFILL_CONCURRENCY = 512
DECODE_CONCURRENCY = 64


@dataclass
class RunningCluster:
    config: ClusterConfig
    workers: dict[str, Any] = field(default_factory=dict)  # actor name → handle
    router: Any = None
    urls: dict[str, str] = field(default_factory=dict)
    started_ray: bool = False

    def pools(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"prefill": [], "decode": [], "colocated": []}
        for name in self.workers:
            out[name.rsplit("-", 1)[0]].append(name)
        return out


def _requested_cpus(config: ClusterConfig) -> float:
    if config.mode == "colocated":
        return config.colocated.initial * config.colocated.num_cpus
    return (
        config.prefill.initial * config.prefill.num_cpus
        + config.decode.initial * config.decode.num_cpus
    )


def connect_ray(config: ClusterConfig, address: str | None) -> bool:
    """Join ``address`` or start a local Ray. Returns True if this call started Ray."""
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


def start_cluster(config: ClusterConfig, address: str | None = None) -> RunningCluster:
    if not config.kv.token:
        config = dataclasses.replace(
            config, kv=dataclasses.replace(config.kv, token=secrets.token_urlsafe(24))
        )
    running = RunningCluster(config=config, started_ray=connect_ray(config, address))
    try:
        _start_workers(running)
        router = (
            ray.remote(RouterActor)
            .options(name="router", namespace=config.namespace, num_cpus=0, max_concurrency=1000)
            .remote()
        )
        running.router = router
        pools = running.pools()
        running.urls = ray.get(
            router.start.remote(
                model=config.model,
                router_config=dataclasses.asdict(config.router),
                prefill=pools["prefill"],
                decode=pools["colocated"] if config.mode == "colocated" else pools["decode"],
                colocated=config.mode == "colocated",
                namespace=config.namespace,
            )
        )
    except BaseException:
        stop_cluster(running)
        raise
    return running


def _start_workers(running: RunningCluster) -> None:
    config = running.config
    if config.mode == "colocated":
        specs = [("colocated", ColocatedWorker, config.colocated, DECODE_CONCURRENCY)]
    else:
        specs = [
            ("decode", DecodeWorker, config.decode, DECODE_CONCURRENCY),
            ("prefill", PrefillWorker, config.prefill, PREFILL_CONCURRENCY),
        ]
    for pool, cls, pool_config, concurrency in specs:
        options = config.worker_options(pool)
        for index in range(pool_config.initial):
            name = f"{pool}-{index}"
            running.workers[name] = (
                ray.remote(cls)
                .options(
                    name=name,
                    namespace=config.namespace,
                    num_cpus=pool_config.num_cpus,
                    num_gpus=pool_config.num_gpus,
                    max_concurrency=concurrency,
                )
                .remote(options, name)
            )
    # Wait until every model is loaded (an error in a constructor surfaces here).
    ray.get([handle.info.remote() for handle in running.workers.values()])


def stop_cluster(running: RunningCluster) -> None:
    """Stop the router, then the workers; shut Ray down if this process started it."""
    if running.router is not None:
        try:
            ray.get(running.router.stop.remote(), timeout=10)
        except Exception as err:  # noqa: BLE001 - shutting down regardless
            logger.warning("router stop: %s", err)
        ray.kill(running.router)
    for handle in running.workers.values():
        try:
            ray.get(handle.shutdown.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - it may already be gone
            pass
        ray.kill(handle)
    running.workers.clear()
    running.router = None
    if running.started_ray:
        ray.shutdown()
