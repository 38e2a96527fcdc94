"""The router as a Ray actor (``router``): hosts the OpenAI-compatible HTTP server and the
gRPC API over a RayBackend, in the actor's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

import ray

from workers.pool import Pool

logger = logging.getLogger(__name__)


def bind_socket(host: str, port: int, what: str) -> socket.socket:
    """A listening TCP socket on host:port; OSError naming ``what`` and the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as err:
        why = os.strerror(err.errno) if err.errno else str(err)
        raise OSError(f"cannot bind the {what} to {host}:{port}: {why}") from None


def check_ports(router_config: dict) -> None:
    """Raise the OSError the router would meet binding its ports, at once, from any process
    of the router's node (``pdcluster serve`` runs there): before a cluster starts for it."""
    from router.config import RouterConfig

    config = RouterConfig(**router_config)
    ports = [(config.port, "HTTP API")]
    if config.grpc_port is not None:
        ports.append((config.grpc_port, "gRPC API"))
    for port, what in ports:
        bind_socket(config.host, port, what).close()


class RouterActor:
    """``bind`` first (the ports are the API's: an error there ends start-up before any model
    loads), then ``start`` once the replicas are ready."""

    def __init__(self) -> None:
        self.backend = None
        self.config = None
        self.http_socket: socket.socket | None = None
        self.http_server = None
        self.http_task: asyncio.Task | None = None
        self.grpc_server = None
        self.urls: dict = {}
        self.namespace = "pdcluster"

    async def bind(self, router_config: dict) -> dict:
        """Bind the HTTP (and gRPC) ports on this node; returns the URLs. Raises OSError
        naming the address when a port cannot be bound (taken, or not this node's)."""
        from router.config import RouterConfig

        self.config = config = RouterConfig(**router_config)
        self.http_socket = bind_socket(config.host, config.port, "HTTP API")
        port = self.http_socket.getsockname()[1]
        self.urls = {"http": f"http://{config.host}:{port}"}
        if config.grpc_port is not None:
            from router.grpc_api import bind_grpc_server

            try:
                self.grpc_server, grpc_port = bind_grpc_server(config)
            except OSError:
                self.http_socket.close()
                raise
            self.urls["grpc"] = f"{config.host}:{grpc_port}"
        return self.urls

    async def start(
        self,
        *,
        model: str,
        limits: dict,
        routing: dict | None = None,
        slo: dict | None = None,
        replicas: dict[str, Pool],
        colocated: bool,
        namespace: str,
    ) -> dict:
        """Connect to the worker actors (``replicas``: actor name → pool), serve on the
        ports ``bind`` holds; returns the URLs. ``slo``: ``{"ttft_ms", "tpot_ms"}`` for
        SLO-aware admission."""
        import uvicorn

        from engine.checkpoint import Checkpoint, served_name
        from router.admission import SLOTargets
        from router.config import RouterLimits, RoutingConfig
        from router.openai_api import create_app, server_config
        from router.ray_backend import RayBackend

        if self.http_socket is None:
            raise RuntimeError("start() before bind()")
        config = self.config
        self.namespace = namespace
        handles = {name: ray.get_actor(name, namespace=namespace) for name in replicas}
        decode_pool = Pool.COLOCATED if colocated else Pool.DECODE
        any_decode = next(name for name, pool in replicas.items() if pool == decode_pool)
        info = await handles[any_decode].info.remote()
        self.backend = RayBackend(
            model_name=served_name(model),
            tokenizer=Checkpoint(model).tokenizer(),
            max_model_len=info["max_model_len"],
            vocab_size=info["vocab_size"],
            block_size=info["block_size"],
            colocated=colocated,
            limits=RouterLimits(**limits),
            routing=RoutingConfig(**(routing or {})),
            slo=None if slo is None else SLOTargets(**slo),
            kv_cache_tokens=info["num_blocks"] * info["block_size"],
        )
        for name, pool in replicas.items():
            self.backend.add_replica(name, pool, handles[name])
        await self.backend.start()
        app = create_app(self.backend, config)
        self.http_server = uvicorn.Server(server_config(app, config))
        self.http_task = asyncio.create_task(self.http_server.serve(sockets=[self.http_socket]))
        while not self.http_server.started:
            if self.http_task.done():
                self.http_task.result()  # re-raise why it could not start
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.05)
        if self.grpc_server is not None:
            from router.grpc_api import serve_grpc

            await serve_grpc(self.grpc_server, self.backend, config)
        return self.urls

    # ---- the controller's view and levers -------------------------------------------------
    async def add_replica(self, name: str, pool: Pool) -> None:
        self.backend.add_replica(name, pool, ray.get_actor(name, namespace=self.namespace))

    async def drain_replica(self, name: str) -> int:
        """Stop routing new work to ``name``; returns its requests still in flight."""
        self.backend.drain_replica(name)
        replica = self.backend.replicas.by_name.get(name)
        return 0 if replica is None else replica.in_flight

    async def remove_replica(self, name: str) -> None:
        self.backend.remove_replica(name)

    async def observation(self, window_s: float, percentile: float, exclude: list[str]) -> dict:
        """The load the planner reads: rates, lengths and latency percentiles over the window,
        plus every replica's latest stats."""
        summary = self.backend.load.summary(window_s, percentile, set(exclude))
        return {
            **summary,
            # The planner reads a full decode pool from this: requests in line behind a
            # blocked head, not those queued behind a reservation call in flight.
            "router_waiting": self.backend.waiting_for_capacity,
            "replicas": self.backend.replica_stats(),
        }

    async def slo_attainment(self, window_s: float, ttft_ms: float, tpot_ms: float) -> float | None:
        return self.backend.load.attainment(window_s, ttft_ms, tpot_ms)

    async def set_extra_metrics(self, exposition: bytes) -> None:
        """Series published by the controller (the planner's), appended to /metrics."""
        from router.metrics import RouterMetrics

        RouterMetrics.of(self.backend).extra_exposition = exposition

    async def replica_stats(self) -> dict:
        return self.backend.replica_stats() if self.backend else {}

    async def backend_stats(self) -> dict:
        return self.backend.stats() if self.backend else {}

    async def stop(self) -> None:
        """Stop serving within ~2 s: streams still open are cut (their clients see the
        connection close), not waited for — a shutdown must not wait on clients."""
        if self.http_server is not None:
            self.http_server.should_exit = True
            self.http_server.force_exit = True  # do not wait for open connections to finish
        if self.grpc_server is not None:
            with contextlib.suppress(Exception):  # never started, if start-up failed
                await self.grpc_server.stop(grace=1.0)
        if self.http_task is not None:
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(self.http_task, timeout=2.0)
        if self.backend is not None:
            await self.backend.stop()
        if self.http_socket is not None:
            self.http_socket.close()
