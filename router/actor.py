"""The router as a Ray actor (``router``): hosts the OpenAI-compatible HTTP server and the
gRPC API over a RayBackend, in the actor's own event loop."""

from __future__ import annotations

import asyncio
import logging

import ray

logger = logging.getLogger(__name__)


class RouterActor:
    def __init__(self) -> None:
        self.backend = None
        self.http_server = None
        self.http_task: asyncio.Task | None = None
        self.grpc_server = None
        self.urls: dict = {}

    async def start(
        self,
        *,
        model: str,
        router_config: dict,
        prefill: list[str],
        decode: list[str],
        colocated: bool,
        namespace: str,
    ) -> dict:
        """Connect to the named worker actors, start serving; returns the URLs."""
        import uvicorn

        from engine.checkpoint import open_tokenizer
        from router.config import RouterConfig
        from router.openai_api import create_app
        from router.ray_backend import RayBackend

        config = RouterConfig(**router_config)
        handles = {name: ray.get_actor(name, namespace=namespace) for name in [*prefill, *decode]}
        info = await handles[decode[0]].info.remote()
        self.backend = RayBackend(
            model_name=model,
            tokenizer=open_tokenizer(model),
            max_model_len=info["max_model_len"],
            vocab_size=info["vocab_size"],
            block_size=info["block_size"],
            decode={name: handles[name] for name in decode},
            prefill={name: handles[name] for name in prefill},
            colocated=colocated,
        )
        await self.backend.start()
        app = create_app(self.backend, config)
        self.http_server = uvicorn.Server(
            uvicorn.Config(
                app, host=config.host, port=config.port, log_level="warning", lifespan="off"
            )
        )
        self.http_task = asyncio.create_task(self.http_server.serve())
        while not self.http_server.started:
            if self.http_task.done():
                self.http_task.result()  # re-raise why it could not start (port taken, ...)
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.05)
        port = self.http_server.servers[0].sockets[0].getsockname()[1]
        self.urls = {"http": f"http://{config.host}:{port}"}
        if config.grpc_port is not None:
            from router.grpc_api import start_grpc_server

            self.grpc_server, grpc_port = await start_grpc_server(self.backend, config)
            self.urls["grpc"] = f"{config.host}:{grpc_port}"
        return self.urls

    async def replica_stats(self) -> dict:
        return self.backend.replica_stats() if self.backend else {}

    async def stop(self) -> None:
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=1.0)
        if self.http_server is not None:
            self.http_server.should_exit = True
            if self.http_task is not None:
                await asyncio.wait_for(self.http_task, timeout=5.0)
        if self.backend is not None:
            await self.backend.stop()
