"""The router: OpenAI-compatible HTTP API, gRPC API and ``RouterClient`` over a
:class:`~router.backend.Backend` (the cluster's actors, or a fake in tests).

    app = create_app(backend, RouterConfig(api_key=...))   # serve with uvicorn
    server, port = await start_grpc_server(backend, config, app.state.metrics)
"""

from __future__ import annotations

from router.backend import (
    Backend,
    GenerateRequest,
    NoReplica,
    Overloaded,
    RequestRejected,
    TokenDelta,
)
from router.config import RouterConfig

__all__ = [
    "Backend",
    "GenerateRequest",
    "NoReplica",
    "Overloaded",
    "RequestRejected",
    "RouterConfig",
    "TokenDelta",
    "create_app",
]


def __getattr__(name: str):
    # Lazily: `router.config` is imported by the CLI for every command, which should not pay
    # for importing FastAPI.
    if name == "create_app":
        from router.openai_api import create_app

        return create_app
    raise AttributeError(f"module 'router' has no attribute {name!r}")
