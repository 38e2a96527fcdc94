"""A live router (uvicorn HTTP + gRPC on 127.0.0.1, free ports) over the fake backend,
running in a background thread with its own event loop."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import uvicorn

from router import RouterConfig, create_app
from router.grpc_api import start_grpc_server
from router.openai_api import server_config
from tests.router.fake_backend import FakeBackend


class LiveRouter:
    def __init__(self, backend: FakeBackend, config: RouterConfig) -> None:
        self.backend = backend
        self.config = config
        self.app = create_app(backend, config)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._server = uvicorn.Server(server_config(self.app, self.config))
        grpc_server, self.grpc_port = await start_grpc_server(self.backend, self.config, port=0)
        task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started and not task.done():
            await asyncio.sleep(0.01)
        self._ready.set()
        await task
        await grpc_server.stop(0)

    def __enter__(self) -> LiveRouter:
        self._thread.start()
        assert self._ready.wait(10), "router did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()


@pytest.fixture(scope="session")
def live_router():
    with LiveRouter(FakeBackend(), RouterConfig(max_body_bytes=64 * 1024)) as router:
        yield router


@pytest.fixture
def router(live_router):
    live_router.backend.reset()
    return live_router


@pytest.fixture
def backend(router) -> FakeBackend:
    return router.backend
