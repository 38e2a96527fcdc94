"""The interface between the router's API layer and the cluster that generates tokens.

The API layer (``openai_api``, ``grpc_api``) validates requests, tokenizes, detokenizes and
measures; a :class:`Backend` only turns token ids into token ids. ``RayBackend`` dispatches
to the prefill and decode actors; the tests use a fake one.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs
from engine.tokenizer import Tokenizer


@dataclass
class GenerateRequest:
    """One validated request: the prompt is already tokenized and fits the model
    (``len(prompt_token_ids) + params.max_tokens <= max_model_len``, ids in the vocabulary)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() when the router received the request
    extra: dict[str, Any] = field(default_factory=dict)  # routing hints (e.g. "user")


@dataclass
class TokenDelta:
    """New tokens of one request, as produced by one or more decode steps (batched: never one
    Ray call per token)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per token when params.logprobs is set
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" on the last delta
    error: str | None = None  # set (with finish_reason "error") if the request failed
    # On the last delta: seconds per stage of the first token's way (router.timeline)
    timings: dict[str, float] | None = None
    # With the first token, when params.prompt_logprobs is set: entry i is prompt token i's
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # On the last delta: prompt tokens served from a prefix cache (OpenAI's
    # usage.prompt_tokens_details.cached_tokens), when the backend knows
    cached_tokens: int | None = None


class BackendError(Exception):
    """Base of the errors a backend raises before the first delta of a request."""


class Overloaded(BackendError):
    """Every replica's queue is full: the client should retry after ``retry_after_s`` (→ 429)."""

    def __init__(self, message: str = "the cluster is overloaded", retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = float(retry_after_s)


class NoReplica(BackendError):
    """No prefill or decode replica is ready to take the request (→ 503)."""


class RequestRejected(BackendError):
    """The request can never be served as asked, e.g. it cannot fit in any KV cache (→ 400).
    The message says why."""


class Backend(abc.ABC):
    """What the router API needs from the cluster. Implementations: ``RayBackend`` (the
    cluster's), ``FakeBackend`` (tests).

    All methods are called from the router's event loop.
    """

    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """An async generator of the request's new tokens; the last delta has a finish_reason.

        Raises :class:`Overloaded`, :class:`NoReplica` or :class:`RequestRejected` from the
        first ``__anext__``, before any delta. Closing it early (``aclose()``, or the task that
        iterates it being cancelled when the client disconnects) must cancel the request on
        every worker and free its KV cache.
        """

    def generate_forks(self, requests: list[GenerateRequest]) -> list[AsyncIterator[TokenDelta]]:
        """Streams of several sequences of one prompt (OpenAI's ``n``; the requests differ
        only in id and sampling params), each as ``generate``'s. A backend may prefill the
        prompt once for all; this one runs them as separate requests."""
        return [self.generate(request) for request in requests]

    @abc.abstractmethod
    async def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "degraded", "prefill": n_ready, "decode": n_ready, ...}``;
        "ok" only when both pools have at least one ready replica."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Gauges for /metrics, read at scrape time (must be cheap, non-blocking):
        ``{"queue_tokens": {actor: n}, "running": {actor: n}, "kv_usage": {actor: fraction},
        "transfer_bytes_total": n, "transfer_seconds_total": s}``. Keys may be missing."""
