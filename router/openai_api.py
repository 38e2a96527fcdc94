"""The OpenAI-compatible HTTP API: ``create_app(backend, config)`` → a FastAPI app.

Routes: POST /v1/completions, POST /v1/chat/completions (``stream: true`` → server-sent
events ending in ``data: [DONE]``), GET /v1/models, GET /health, GET /metrics.

Every request is validated (bodies and field models in ``openai_protocol``, the rest here)
before the backend sees it; each problem is a 400 (404 for an unknown model, 413 for an
oversize body) with OpenAI's error body saying what is wrong.
With ``RouterConfig.api_key`` set, /v1/* needs ``Authorization: Bearer <key>``. A client
that disconnects cancels its request: the backend's generator is closed.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.sequence import TokenLogprobs
from router.backend import Backend, GenerateRequest
from router.config import RouterConfig
from router.errors import APIError, bad_request
from router.generation import (
    TextDelta,
    generate_text,
    logprob_entries,
    new_request_id,
    sampling_params,
    tokenize_chat,
    tokenize_prompt,
)
from router.metrics import RouterMetrics
from router.openai_protocol import (
    ChatCompletionRequest,
    CommonRequest,
    CompletionRequest,
    chat_messages,
    read_json_body,
    single_prompt,
    validation_error,
)

T = TypeVar("T")


@dataclass
class _Prepared:
    """A validated request and how to present its result."""

    kind: Literal["completion", "chat"]
    request: GenerateRequest
    model: str
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: bool
    return_timings: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    text_offset: int = 0  # completions logprobs: where the next token's text starts


class OpenAIServer:
    """The handlers' logic; one per app. ``api`` labels in metrics: completions, chat."""

    def __init__(self, backend: Backend, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self.model_name = config.served_model_name or backend.model_name

    # ---- validation (all of it, before any backend call) ---------------------------------
    def _check_common(self, req: CommonRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(
                404,
                f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if req.n != 1:
            raise bad_request("only n=1 is supported", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise bad_request(f"{name} is not supported (must be 0 or absent)", name)
        if req.stream_options is not None and not req.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )

    def prepare_completion(self, body: dict[str, Any], arrival: float) -> _Prepared:
        try:
            req = CompletionRequest.model_validate(body)
        except ValidationError as err:
            raise validation_error(err) from None
        self._check_common(req)
        if req.echo:
            raise bad_request("echo is not supported", "echo")
        ids = tokenize_prompt(self.backend, single_prompt(req.prompt))
        params = self._params(
            req, ids, req.max_tokens, self.config.default_max_tokens, req.logprobs
        )
        return self._prepared(
            "completion", "cmpl", req, ids, params, arrival, req.logprobs is not None
        )

    def prepare_chat(self, body: dict[str, Any], arrival: float) -> _Prepared:
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as err:
            raise validation_error(err) from None
        self._check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        ids = tokenize_chat(self.backend, chat_messages(req.messages))
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, param = req.max_tokens, "max_tokens"
        top = (req.top_logprobs or 0) if req.logprobs else None
        # Chat's default is whatever the context leaves (capped by the server), as OpenAI's.
        params = self._params(req, ids, max_tokens, None, top, param)
        return self._prepared("chat", "chatcmpl", req, ids, params, arrival, req.logprobs)

    def _params(self, req, ids, max_tokens, default, logprobs, param="max_tokens"):
        return sampling_params(
            self.backend,
            self.config,
            len(ids),
            max_tokens=max_tokens,
            default_max_tokens=default,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            min_tokens=req.min_tokens,
            max_tokens_param=param,
        )

    def _prepared(self, kind, prefix, req, ids, params, arrival, logprobs) -> _Prepared:
        request = GenerateRequest(new_request_id(prefix), ids, params, arrival)
        if req.user is not None:
            request.extra["user"] = req.user
        return _Prepared(
            kind=kind,
            request=request,
            model=self.model_name,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            return_token_ids=req.return_token_ids,
            return_timings=req.return_timings,
            logprobs=bool(logprobs),
        )

    # ---- running ---------------------------------------------------------------------
    async def respond(self, http: Request, prep: _Prepared) -> Response:
        api = "completions" if prep.kind == "completion" else "chat"
        stream = generate_text(self.backend, prep.request, self.metrics, api)
        if prep.stream:
            # The first delta is awaited here so that a backend refusal (429/503/400) is the
            # response's status, not an error event inside a 200 stream.
            done, first = await _unless_disconnected(http, stream.__anext__)
            if done:
                return EventStreamResponse(self._events(prep, first, stream))
        else:

            async def collect() -> list[TextDelta]:
                return [delta async for delta in stream]

            done, deltas = await _unless_disconnected(http, collect)
            if done:
                return JSONResponse(self._full_response(prep, deltas))
        return Response(status_code=499)  # the client went away; nobody reads this

    async def _events(self, prep: _Prepared, first: TextDelta, stream):
        num_tokens = 0
        try:
            delta: TextDelta | None = first
            while delta is not None:
                num_tokens += len(delta.token_ids)
                yield _sse(self._chunk(prep, delta, is_first=delta is first))
                delta = None if delta.finish_reason else await stream.__anext__()
            if prep.include_usage:
                chunk = self._envelope(prep, chunk=True)
                chunk.update(choices=[], usage=_usage(prep, num_tokens))
                yield _sse(chunk)
            yield "data: [DONE]\n\n"
        except APIError as err:  # failed mid-stream: the status line is already sent
            yield _sse(err.body())
            yield "data: [DONE]\n\n"
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    # ---- presentation (OpenAI's formats) --------------------------------------------------
    def _envelope(self, prep: _Prepared, chunk: bool) -> dict[str, Any]:
        if prep.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {
            "id": prep.request.request_id,
            "object": obj,
            "created": prep.created,
            "model": prep.model,
        }

    def _choice(self, prep: _Prepared, text, token_ids, logprobs, finish, chunk, is_first):
        if prep.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": text}
        elif chunk:
            delta = {"role": "assistant", "content": text} if is_first else {"content": text}
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        choice["logprobs"] = self._logprobs(prep, logprobs) if prep.logprobs else None
        choice["finish_reason"] = finish
        if prep.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _chunk(self, prep: _Prepared, delta: TextDelta, is_first: bool) -> dict[str, Any]:
        out = self._envelope(prep, chunk=True)
        choice = self._choice(
            prep, delta.text, delta.token_ids, delta.logprobs, delta.finish_reason, True, is_first
        )
        out["choices"] = [choice]
        if prep.include_usage:
            out["usage"] = None
        if prep.return_token_ids and is_first:
            out["prompt_token_ids"] = prep.request.prompt_token_ids
        if prep.return_timings and delta.timings:
            out["timings_ms"] = _milliseconds(delta.timings)
        return out

    def _full_response(self, prep: _Prepared, deltas: list[TextDelta]) -> dict[str, Any]:
        token_ids = [t for d in deltas for t in d.token_ids]
        logprobs = [lp for d in deltas for lp in (d.logprobs or ())]
        text = "".join(d.text for d in deltas)
        out = self._envelope(prep, chunk=False)
        out["choices"] = [
            self._choice(prep, text, token_ids, logprobs, deltas[-1].finish_reason, False, False)
        ]
        out["usage"] = _usage(prep, len(token_ids))
        if prep.return_token_ids:
            out["prompt_token_ids"] = prep.request.prompt_token_ids
        timings = next((d.timings for d in deltas if d.timings), None)
        if prep.return_timings and timings:
            out["timings_ms"] = _milliseconds(timings)
        return out

    def _logprobs(self, prep: _Prepared, logprobs: list[TokenLogprobs] | None) -> dict[str, Any]:
        entries = logprob_entries(self.backend.tokenizer, logprobs or [])
        if prep.kind == "chat":
            return {
                "content": [
                    {
                        "token": tok,
                        "logprob": lp,
                        "bytes": list(tok.encode("utf-8", "replace")),
                        "top_logprobs": [
                            {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))}
                            for t, v in top
                        ],
                    }
                    for tok, lp, top in entries
                ]
            }
        offsets = []
        for tok, _, _ in entries:
            offsets.append(prep.text_offset)
            prep.text_offset += len(tok)
        return {
            "tokens": [tok for tok, _, _ in entries],
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries],
            "text_offset": offsets,
        }


def _usage(prep: _Prepared, completion_tokens: int) -> dict[str, int]:
    prompt = len(prep.request.prompt_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


def _milliseconds(seconds: dict[str, float]) -> dict[str, float]:
    return {stage: round(value * 1e3, 3) for stage, value in seconds.items()}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _unless_disconnected(
    http: Request, work: Callable[[], Awaitable[T]]
) -> tuple[bool, T | None]:
    """Run ``work()`` unless the client disconnects first; then it is cancelled (which closes
    the generation it awaits, cancelling the request) and (False, None) returned."""
    result: T | None = None
    finished = False
    error: APIError | None = None

    async def watch(scope: anyio.CancelScope) -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        try:
            result = await work()
            finished = True
        except APIError as err:  # re-raised below, not wrapped in an exception group
            error = err
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return finished, result


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop, and close their generator, when the client disconnects.

    Starlette only notices a disconnect on its next write under ASGI 2.4; this listens for
    it all along, so a request waiting on its first token is cancelled at once.
    """

    media_type = "text/event-stream"

    def __init__(self, content) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        async def stream(scope_: anyio.CancelScope) -> None:
            try:
                await self.stream_response(send)
            except OSError:
                pass  # the client is gone
            scope_.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream, tg.cancel_scope)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


# ---- the app -----------------------------------------------------------------------------


def _api_of(path: str) -> str:
    if path.startswith("/v1/chat"):
        return "chat"
    if path.startswith("/v1/completions"):
        return "completions"
    return "other"


def create_app(
    backend: Backend, config: RouterConfig | None = None, metrics: RouterMetrics | None = None
) -> FastAPI:
    """The router's HTTP app over ``backend``. Serve it with uvicorn on config.host:port."""
    config = config or RouterConfig()
    metrics = metrics or RouterMetrics.of(backend)
    server = OpenAIServer(backend, config, metrics)
    app = FastAPI(title="pdcluster router", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.state.metrics = metrics

    async def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), config.api_key.encode()
        ):
            raise APIError(
                401,
                "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        if not err.counted:
            metrics.count(_api_of(request.url.path), err.status_label)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        body = APIError(err.status_code, str(err.detail)).body()
        return JSONResponse(body, status_code=err.status_code, headers=err.headers)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        body = await read_json_body(request, config.max_body_bytes)
        return await server.respond(request, server.prepare_completion(body, arrival))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        body = await read_json_body(request, config.max_body_bytes)
        return await server.respond(request, server.prepare_chat(body, arrival))

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        card = {
            "id": server.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdcluster",
            "max_model_len": backend.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            state = await backend.health()
        except Exception as err:  # unhealthy, not a server error
            state = {"status": "error", "error": f"{type(err).__name__}: {err}"}
        return JSONResponse(state, status_code=200 if state.get("status") == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        content, content_type = metrics.render()
        return Response(content, media_type=content_type)

    return app
