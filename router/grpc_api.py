"""The router's gRPC API (``protos/router.proto``): Generate (server streaming) and Health,
over the same :class:`Backend`, validation and metrics as the HTTP API.

Start it in the router's event loop with :func:`start_grpc_server`; it listens on
``RouterConfig.host`` (loopback by default). The API key, if configured, is read from the
``authorization: Bearer <key>`` metadata. A client that cancels its call cancels the request.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator

import grpc

from protos import router_pb2, router_pb2_grpc
from router.backend import Backend, GenerateRequest
from router.config import RouterConfig
from router.errors import APIError
from router.generation import (
    GenerationStats,
    generate_text,
    new_request_id,
    sampling_params,
    tokenize_chat,
    tokenize_prompt,
)
from router.metrics import RouterMetrics
from router.openai_protocol import chat_messages

# The gRPC status of each HTTP status the API layer uses.
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, backend: Backend, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self.model_name = config.served_model_name or backend.model_name

    async def Generate(  # noqa: N802 (the RPC's name)
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        arrival = time.monotonic()
        try:
            self._authorize(context)
            gen_request = self._prepare(request, arrival)
        except APIError as err:
            self.metrics.count("grpc", err.status_label)
            await _abort(context, err)
        stats = GenerationStats(len(gen_request.prompt_token_ids))
        stream = generate_text(self.backend, gen_request, self.metrics, "grpc", stats)
        first = True
        try:
            async for delta in stream:
                response = router_pb2.GenerateResponse(
                    request_id=gen_request.request_id,
                    text=delta.text,
                    token_ids=delta.token_ids,
                    finish_reason=delta.finish_reason or "",
                )
                for lp in delta.logprobs or ():
                    response.logprobs.add(
                        token_id=lp.token_id,
                        logprob=lp.logprob,
                        top=[
                            router_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top.items()
                        ],
                    )
                if first:
                    response.prompt_token_ids.extend(gen_request.prompt_token_ids)
                    first = False
                if delta.finish_reason:
                    response.usage.prompt_tokens = stats.num_prompt_tokens
                    response.usage.completion_tokens = stats.num_output_tokens
                    if delta.cached_tokens is not None:
                        response.usage.cached_tokens = min(
                            delta.cached_tokens, stats.num_prompt_tokens
                        )
                yield response
        except APIError as err:
            await _abort(context, err)
        finally:
            await stream.aclose()

    async def Health(  # noqa: N802
        self, request: router_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.HealthResponse:
        try:
            state = await self.backend.health()
        except Exception as err:
            state = {"status": "error", "error": f"{type(err).__name__}: {err}"}
        return router_pb2.HealthResponse(
            status=str(state.get("status", "error")),
            prefill=int(state.get("prefill", 0)),
            decode=int(state.get("decode", 0)),
            details_json=json.dumps(state, default=str),
        )

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self.config.api_key is None:
            return
        metadata = dict(context.invocation_metadata() or ())
        scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), self.config.api_key.encode()
        ):
            raise APIError(
                401, "missing or invalid API key: send metadata authorization: Bearer <key>"
            )

    def _prepare(self, request: router_pb2.GenerateRequest, arrival: float) -> GenerateRequest:
        if request.model and request.model != self.model_name:
            raise APIError(
                404,
                f"the model {request.model!r} does not exist; this server serves {self.model_name!r}",
            )
        which = request.WhichOneof("prompt")
        if which is None:
            raise APIError(400, "prompt is required: set text, token_ids or chat", param="prompt")
        if which == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            ids = tokenize_chat(self.backend, chat_messages(messages))
        else:
            prompt = request.text if which == "text" else list(request.token_ids.ids)
            ids = tokenize_prompt(self.backend, prompt)

        def opt(name: str):
            return getattr(request, name) if request.HasField(name) else None

        params = sampling_params(
            self.backend,
            self.config,
            len(ids),
            max_tokens=opt("max_tokens"),
            default_max_tokens=self.config.default_max_tokens,
            temperature=opt("temperature"),
            top_p=opt("top_p"),
            top_k=opt("top_k"),
            seed=opt("seed"),
            stop=list(request.stop),
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            logprobs=opt("logprobs"),
            min_tokens=request.min_tokens,
        )
        request_id = request.request_id or new_request_id("grpc")
        return GenerateRequest(request_id, ids, params, arrival)


async def _abort(context: grpc.aio.ServicerContext, err: APIError) -> None:
    if "Retry-After" in err.headers:
        context.set_trailing_metadata((("retry-after", err.headers["Retry-After"]),))
    await context.abort(STATUS_CODES.get(err.status, grpc.StatusCode.UNKNOWN), err.message)


async def start_grpc_server(
    backend: Backend,
    config: RouterConfig,
    metrics: RouterMetrics | None = None,
    port: int | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC server on ``config.host``:``port`` (default ``config.grpc_port``; 0
    picks a free port) in the running event loop. Returns the server (``await
    server.stop(grace)`` to end it) and the port it is bound to. ``metrics`` defaults to the
    backend's (``RouterMetrics.of``), the registry the HTTP app's /metrics shows."""
    server, bound = bind_grpc_server(config, port)
    await serve_grpc(server, backend, config, metrics)
    return server, bound


def bind_grpc_server(config: RouterConfig, port: int | None = None) -> tuple[grpc.aio.Server, int]:
    """A gRPC server bound to ``config.host``:``port`` (default ``config.grpc_port``) but
    not serving yet: a port that cannot be bound is an OSError before anything else starts.
    Needs the running event loop."""
    port = config.grpc_port if port is None else port
    if port is None:
        raise ValueError("no gRPC port: RouterConfig.grpc_port is None and none was given")
    server = grpc.aio.server()
    try:
        bound = server.add_insecure_port(f"{config.host}:{port}")
    except RuntimeError as err:  # grpcio raises this where it cannot bind
        raise OSError(f"cannot bind the gRPC API to {config.host}:{port}: {err}") from None
    if bound == 0:
        raise OSError(f"cannot bind the gRPC API to {config.host}:{port}")
    return server, bound


async def serve_grpc(
    server: grpc.aio.Server,
    backend: Backend,
    config: RouterConfig,
    metrics: RouterMetrics | None = None,
) -> None:
    """Serve the router's gRPC API over ``backend`` on a server ``bind_grpc_server`` bound."""
    servicer = RouterServicer(backend, config, metrics or RouterMetrics.of(backend))
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    await server.start()
