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

import dataclasses
import functools
import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import InvalidRequestError
from engine.structured_output import GrammarCompiler, GrammarSpec
from router.backend import Backend, GenerateRequest
from router.config import RouterConfig
from router.errors import APIError, bad_request
from router.generation import (
    GenerationStats,
    TextDelta,
    generate_text,
    new_request_id,
    sampling_params,
    tokenize_chat,
    tokenize_prompt,
)
from router.http_streams import (
    EventStreamResponse,
    all_of,
    close_all,
    collect,
    unless_disconnected,
)
from router.metrics import RouterMetrics
from router.openai_format import Prepared, ResponseFormat, sse
from router.openai_protocol import (
    ChatCompletionRequest,
    CommonRequest,
    CompletionRequest,
    chat_messages,
    grammar_of,
    prompt_list,
    read_json_body,
    refuse_unserved,
    validation_error,
)
from router.tool_calls import describe_tools, tool_grammar, tool_use

R = TypeVar("R", bound=CommonRequest)


class OpenAIServer:
    """The handlers' logic; one per app. ``api`` labels in metrics: completions, chat."""

    def __init__(self, backend: Backend, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self.model_name = config.served_model_name or backend.model_name
        self.format = ResponseFormat(backend.tokenizer)
        self._grammars: GrammarCompiler | None = None  # made for the first grammar asked for

    # ---- validation (all of it, before any backend call) ---------------------------------
    def _validated(self, body: dict[str, Any], kind: str, model: type[R]) -> R:
        """The body as a ``model`` request, every field checked (400s say which)."""
        refuse_unserved(body, kind)
        try:
            req = model.model_validate(body)
        except ValidationError as err:
            raise validation_error(err) from None
        self._check_common(req)
        return req

    def _check_common(self, req: CommonRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(
                404,
                f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if not 1 <= req.n <= self.config.max_n:
            raise bad_request(f"n must be in [1, {self.config.max_n}], got {req.n}", "n")
        if req.stream_options is not None and not req.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )

    def prepare_completion(self, body: dict[str, Any], arrival: float) -> Prepared:
        req = self._validated(body, "completion", CompletionRequest)
        grammar = grammar_of(req)
        prompts = prompt_list(req.prompt, self.config.max_prompts_per_request)
        many = len(prompts) > 1
        ids = [
            tokenize_prompt(self.backend, p, f"prompt[{i}]" if many else "prompt")
            for i, p in enumerate(prompts)
        ]
        # echo with logprobs: the prompt's too (computed during its prefill)
        prompt_logprobs = req.logprobs if req.echo else None
        params = [
            self._params(
                req,
                one,
                req.max_tokens,
                self.config.default_max_tokens,
                req.logprobs,
                grammar,
                prompt_logprobs=prompt_logprobs,
            )
            for one in ids
        ]
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else self.backend.tokenizer.decode(p) for p in prompts]
            echo = [text for text in echo for _ in range(req.n)]  # one per choice
        return self._prepared(
            "completion",
            "cmpl",
            req,
            ids,
            params,
            arrival,
            req.logprobs is not None,
            echo,
            grammar,
        )

    def prepare_chat(self, body: dict[str, Any], arrival: float) -> Prepared:
        req = self._validated(body, "chat", ChatCompletionRequest)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        grammar = grammar_of(req)
        messages = chat_messages(req.messages)
        use = tool_use(req.tools, req.tool_choice)
        template_tools = None
        if use is not None:
            if use.forced and grammar is not None:
                raise bad_request(
                    "a forced tool call and a response format cannot be asked for together",
                    "tool_choice",
                )
            if getattr(self.backend.tokenizer, "chat_template_takes_tools", False):
                template_tools = req.tools
            else:  # described in a system message, as servers do for such templates
                messages = _with_system_text(messages, describe_tools(use))
            if use.forced:
                grammar = ("tool_choice", tool_grammar(use))
        ids = tokenize_chat(self.backend, messages, template_tools)
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, param = req.max_tokens, "max_tokens"
        top = (req.top_logprobs or 0) if req.logprobs else None
        # Chat's default is whatever the context leaves (capped by the server), as OpenAI's.
        params = self._params(req, ids, max_tokens, None, top, grammar, param)
        return self._prepared(
            "chat",
            "chatcmpl",
            req,
            [ids],
            [params],
            arrival,
            req.logprobs,
            grammar=grammar,
            tools=use,
        )

    def _params(
        self,
        req,
        ids,
        max_tokens,
        default,
        logprobs,
        grammar,
        param="max_tokens",
        prompt_logprobs=None,
    ):
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
            prompt_logprobs=prompt_logprobs,
            min_tokens=req.min_tokens,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=req.logit_bias,
            grammar=grammar[1] if grammar else None,
            max_tokens_param=param,
        )

    async def check_grammars(self, prep: Prepared) -> None:
        """A 400 with the grammar library's message for a grammar that cannot compile
        (compiled off the event loop: the first one loads xgrammar, seconds)."""
        spec = prep.requests[0].params.grammar  # one request body, one grammar
        if spec is None:
            return
        try:
            await anyio.to_thread.run_sync(self._compile, spec)
        except InvalidRequestError as err:
            raise bad_request(str(err), prep.grammar_param) from None

    def _compile(self, spec: GrammarSpec) -> None:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.backend.tokenizer, self.backend.vocab_size)
        self._grammars.compile(spec)

    def _prepared(
        self, kind, prefix, req, ids, params, arrival, logprobs, echo=None, grammar=None, tools=None
    ):
        request_id = new_request_id(prefix)
        many = len(ids) * req.n > 1
        requests = [
            # Each choice is its own request in the cluster, "<id>-<choice index>"; the n
            # choices of a prompt are consecutive and, seeded, draw with seed + i.
            GenerateRequest(
                f"{request_id}-{index * req.n + i}" if many else request_id,
                one,
                p if p.seed is None else dataclasses.replace(p, seed=p.seed + i),
                arrival,
            )
            for index, (one, p) in enumerate(zip(ids, params, strict=True))
            for i in range(req.n)
        ]
        for request in requests:
            if req.user is not None:
                request.extra["user"] = req.user
        return Prepared(
            kind=kind,
            request_id=request_id,
            requests=requests,
            n=req.n,
            model=self.model_name,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            return_token_ids=req.return_token_ids,
            return_timings=req.return_timings,
            logprobs=bool(logprobs),
            echo=echo,
            grammar_param=grammar[0] if grammar else None,
            tools=tools,
        )

    # ---- running ---------------------------------------------------------------------
    async def respond(self, http: Request, prep: Prepared) -> Response:
        api = "completions" if prep.kind == "completion" else "chat"
        streams = []
        for first in range(0, len(prep.requests), prep.n):  # the n choices of each prompt
            choices = prep.requests[first : first + prep.n]
            tokens = self.backend.generate_forks(choices)
            streams += [
                # the prompt's tokens are counted once, with its first choice
                generate_text(
                    self.backend,
                    r,
                    self.metrics,
                    api,
                    GenerationStats(len(r.prompt_token_ids) if i == 0 else 0),
                    stream=t,
                )
                for i, (r, t) in enumerate(zip(choices, tokens, strict=True))
            ]
        try:
            if prep.stream:
                # Every choice's first delta is awaited here, so that a backend refusal
                # (429/503/400) is the response's status, not an error event in a 200 stream.
                done, firsts = await unless_disconnected(
                    http, lambda: all_of([s.__anext__ for s in streams])
                )
                if done:
                    body = self._events(prep, firsts, streams)
                    streams = []  # the event stream closes them
                    return EventStreamResponse(body)
            else:
                done, results = await unless_disconnected(
                    http, lambda: all_of([functools.partial(collect, s) for s in streams])
                )
                if done:
                    return JSONResponse(self.format.full_response(prep, results))
            return Response(status_code=499)  # the client went away; nobody reads this
        finally:
            await close_all(streams)

    async def _events(self, prep: Prepared, firsts: list[TextDelta], streams):
        """Each choice streams in turn: the others' requests run meanwhile, their tokens
        waiting in the backend until their turn. With tools, a choice's text goes through
        its own tool-call reader, which holds back what may still be a call."""
        num_tokens = 0
        cached: list[int | None] = []
        try:
            for index, (first, stream) in enumerate(zip(firsts, streams, strict=True)):
                tools = self.format.tool_stream(prep, index) if prep.tools is not None else None
                delta: TextDelta | None = first
                while delta is not None:
                    num_tokens += len(delta.token_ids)
                    if tools is None:
                        yield sse(self.format.chunk(prep, index, delta, is_first=delta is first))
                    else:
                        for chunk in tools.add(delta):
                            yield sse(chunk)
                    if delta.finish_reason:
                        cached.append(delta.cached_tokens)
                    delta = None if delta.finish_reason else await stream.__anext__()
            if prep.include_usage:
                yield sse(self.format.usage_chunk(prep, num_tokens, cached))
            yield "data: [DONE]\n\n"
        except APIError as err:  # failed mid-stream: the status line is already sent
            yield sse(err.body())
            yield "data: [DONE]\n\n"
        finally:
            await close_all(streams)


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``text`` added to the system message (one put first if there is none)."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}".strip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ---- the app -----------------------------------------------------------------------------


def _api_of(path: str) -> str:
    if path.startswith("/v1/chat"):
        return "chat"
    if path.startswith("/v1/completions"):
        return "completions"
    return "other"


def server_config(app: FastAPI, config: RouterConfig) -> uvicorn.Config:
    """The uvicorn settings the router's HTTP app is served with (host, port, keep-alive)."""
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        timeout_keep_alive=config.keep_alive_s,
        log_level="warning",
        lifespan="off",
    )


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

    async def serve(request: Request, prepare: Callable[[dict, float], Prepared]) -> Response:
        arrival = time.monotonic()
        body = await read_json_body(request, config.max_body_bytes)
        prep = prepare(body, arrival)
        await server.check_grammars(prep)
        return await server.respond(request, prep)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        return await serve(request, server.prepare_completion)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        return await serve(request, server.prepare_chat)

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
