"""What the HTTP and gRPC APIs share: turning a request's fields into a validated
:class:`GenerateRequest`, and running it on the backend as a stream of text deltas
(detokenized, cut at stop strings, measured).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs
from engine.structured_output import GrammarSpec
from router.backend import (
    Backend,
    GenerateRequest,
    NoReplica,
    Overloaded,
    RequestRejected,
    TokenDelta,
)
from router.config import RouterConfig
from router.errors import APIError, bad_request
from router.metrics import RouterMetrics

MAX_SEED = 2**63 - 1


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def tokenize_prompt(
    backend: Backend, prompt: str | Sequence[int], param: str = "prompt"
) -> list[int]:
    """Prompt text (tokenized with the model's special tokens) or token ids, checked against
    the vocabulary and the model's length limit (room for at least one new token)."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", param)
        ids = backend.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        if not ids:
            raise bad_request("prompt must not be empty", param)
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < backend.vocab_size:
                raise bad_request(
                    f"prompt token id {t!r} at position {i} is outside the vocabulary "
                    f"[0, {backend.vocab_size})",
                    param,
                )
    check_prompt_length(backend, len(ids), param)
    return ids


def tokenize_chat(
    backend: Backend, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Chat messages rendered with the model's chat template (with the assistant's turn
    opened; ``tools`` for a template that renders them), tokenized, checked against the
    model's length limit."""
    tokenizer = backend.tokenizer
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except InvalidRequestError as err:
        raise bad_request(str(err), "messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    check_prompt_length(backend, len(ids), "messages")
    return ids


def check_prompt_length(backend: Backend, num_tokens: int, param: str = "prompt") -> None:
    if num_tokens + 1 > backend.max_model_len:
        raise bad_request(
            f"the prompt has {num_tokens} tokens but this model's maximum context length is "
            f"{backend.max_model_len} tokens, including at least one generated token",
            param,
        )


def sampling_params(
    backend: Backend,
    config: RouterConfig,
    num_prompt_tokens: int,
    *,
    max_tokens: int | None,
    default_max_tokens: int | None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    min_tokens: int = 0,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: dict[str, float] | None = None,
    grammar: GrammarSpec | None = None,
    max_tokens_param: str = "max_tokens",
) -> SamplingParams:
    """Validated sampling options. ``max_tokens`` None takes ``default_max_tokens`` (None:
    as many as the model's context leaves). max_tokens is capped at what the context leaves,
    so the backend reserves only KV the request can use (it then finishes with "length")."""
    room = backend.max_model_len - num_prompt_tokens
    if max_tokens is None:
        max_tokens = min(default_max_tokens or room, room, config.max_tokens_limit)
    elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise bad_request(f"{max_tokens_param} must be a positive integer", max_tokens_param)
    elif max_tokens > config.max_tokens_limit:
        raise bad_request(
            f"{max_tokens_param} is {max_tokens}; this server allows at most "
            f"{config.max_tokens_limit}",
            max_tokens_param,
        )
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > config.max_stop_strings:
        raise bad_request(f"at most {config.max_stop_strings} stop strings are allowed", "stop")
    if any(isinstance(s, str) and len(s) > config.max_stop_string_len for s in stops):
        raise bad_request(
            f"stop strings may be at most {config.max_stop_string_len} characters", "stop"
        )
    for t in stop_token_ids or ():
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < backend.vocab_size:
            raise bad_request(
                f"stop_token_ids entry {t!r} is outside the vocabulary [0, {backend.vocab_size})",
                "stop_token_ids",
            )
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise bad_request(f"seed must be in [0, {MAX_SEED}]", "seed")
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    bias = _logit_bias(backend, logit_bias or {})
    try:
        return SamplingParams(
            max_tokens=min(max_tokens, room),
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k or 0,
            seed=seed,
            stop=stops,
            stop_token_ids=tuple(stop_token_ids or ()),
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            min_tokens=min(min_tokens, room),  # a long min_tokens still ends at the context
            presence_penalty=presence_penalty or 0.0,
            frequency_penalty=frequency_penalty or 0.0,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            logit_bias=bias,
            grammar=grammar,
        )
    except InvalidRequestError as err:
        raise bad_request(str(err), _param_of(str(err))) from None


def _logit_bias(backend: Backend, bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: JSON object keys are token ids written as decimal strings."""
    pairs = []
    for key, value in bias.items():
        if not key.isdigit() or not 0 <= int(key) < backend.vocab_size:
            raise bad_request(
                f"logit_bias key {key!r} is not a token id in the vocabulary "
                f"[0, {backend.vocab_size})",
                "logit_bias",
            )
        pairs.append((int(key), value))
    return tuple(pairs)


def _param_of(message: str) -> str | None:
    name = message.split(" ", 1)[0]
    return name if name.isidentifier() else None


@dataclass
class TextDelta:
    """What the APIs send for one backend delta: presentable text and the new tokens."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    timings: dict[str, float] | None = None  # on the last delta (router.timeline)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first, when asked
    cached_tokens: int | None = None  # on the last: prompt tokens a prefix cache served


@dataclass
class GenerationStats:
    num_prompt_tokens: int
    num_output_tokens: int = 0


async def generate_text(
    backend: Backend,
    request: GenerateRequest,
    metrics: RouterMetrics,
    api: str,
    stats: GenerationStats | None = None,
    stream: AsyncIterator[TokenDelta] | None = None,
) -> AsyncIterator[TextDelta]:
    """Run ``request`` on the backend (``stream``: its token stream, when made already, e.g.
    by ``generate_forks``); yield text deltas, the last with a finish_reason.

    Backend errors before the first delta become :class:`APIError` (429 with Retry-After,
    503, 400); a request that fails later raises APIError(500) where it fails. Closing this generator, or cancelling
    the task iterating it, closes the backend's generator, which cancels the request.
    Outcome and latencies go to ``metrics``.
    """
    params = request.params
    detok = IncrementalDetokenizer(
        backend.tokenizer, params.stop, prompt_token_ids=request.prompt_token_ids
    )
    stats = stats or GenerationStats(len(request.prompt_token_ids))
    stream = stream if stream is not None else backend.generate(request)
    status = "cancelled"  # unless we get to the end
    first = last = None
    metrics.in_flight.inc()
    try:
        try:
            async for delta in stream:
                if delta.token_ids:
                    last = time.monotonic()
                    first = first or last
                    stats.num_output_tokens += len(delta.token_ids)
                if delta.finish_reason == "error" or delta.error:
                    status = "error"
                    raise APIError(500, f"generation failed: {delta.error or 'unknown error'}")
                text = detok.add(delta.token_ids)
                finish = delta.finish_reason
                if detok.stopped and finish is None:
                    # A stop string completed that the backend has not acted on yet: end here
                    # (the finally below closes the backend's generator, cancelling it).
                    finish = "stop"
                if finish is not None:
                    text += detok.finish()
                    status = "ok" if finish in ("stop", "length") else "aborted"
                if delta.timings:
                    metrics.observe_stages(delta.timings)
                yield TextDelta(
                    text,
                    list(delta.token_ids),
                    delta.logprobs,
                    finish,
                    delta.timings,
                    delta.prompt_logprobs,
                    delta.cached_tokens if finish is not None else None,
                )
                if finish is not None:
                    return
            status = "error"
            raise APIError(500, "the backend ended the request without a finish reason")
        except Overloaded as err:
            status = "overloaded"
            retry = max(1, int(-(-err.retry_after_s // 1)))  # whole seconds, rounded up
            raise APIError(
                429,
                str(err) or "overloaded",
                code="overloaded",
                headers={"Retry-After": str(retry)},
            ) from None
        except NoReplica as err:
            status = "no_replica"
            raise APIError(503, str(err) or "no replica is available", code="no_replica") from None
        except RequestRejected as err:
            status = "rejected_400"
            raise APIError(400, str(err), code="request_rejected") from None
        except APIError:
            raise
        except Exception as err:
            status = "error"
            raise APIError(500, f"internal error: {type(err).__name__}: {err}") from err
    except APIError as err:
        err.counted = True  # counted below, by its real outcome; the HTTP layer must not again
        raise
    finally:
        metrics.in_flight.dec()
        with anyio.CancelScope(shield=True):
            await stream.aclose()  # cancels the request unless it finished
        metrics.count(api, status)
        if first is not None or status == "ok":
            metrics.prompt_tokens.inc(stats.num_prompt_tokens)
        metrics.generation_tokens.inc(stats.num_output_tokens)
        if status == "ok":
            metrics.observe_request(request.arrival_time, first, last, stats.num_output_tokens)


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token's text as the logprob formats show it (special tokens included)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def logprob_entries(
    tokenizer: Any, logprobs: Sequence[TokenLogprobs]
) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token text, logprob, [(top token text, logprob)]) per token, for the API formats."""

    def text(token_id: int) -> str:
        return token_text(tokenizer, token_id)

    return [
        (
            text(lp.token_id),
            lp.logprob,
            [(text(t), v) for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1])],
        )
        for lp in logprobs
    ]
