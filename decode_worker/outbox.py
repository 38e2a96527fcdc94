"""Tokens waiting to be collected by the router, batched per decode step.

The engine loop appends every sampled token; the router collects everything new for all
of its requests with one long-poll call, so streaming costs one Ray call per poll, not one
per token per request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from engine.sequence import TokenLogprobs
from workers.messages import TokenBatch


@dataclass
class _Pending:
    """One request's batch while it accumulates."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first token
    finish_reason: str | None = None
    error: str | None = None
    retryable: bool = False
    num_cached_tokens: int | None = None

    def batch(self) -> TokenBatch:
        return TokenBatch(
            token_ids=tuple(self.token_ids),
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            prompt_logprobs=None if self.prompt_logprobs is None else tuple(self.prompt_logprobs),
            finish_reason=self.finish_reason,
            error=self.error,
            retryable=self.retryable,
            num_cached_tokens=self.num_cached_tokens,
        )


class TokenOutbox:
    """Thread-safe: producers ``add``/``finish``; one consumer ``collect``s."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self._ready = threading.Condition()

    def add(self, request_id: str, token: int, logprob: TokenLogprobs | None = None) -> None:
        with self._ready:
            delta = self._pending.setdefault(request_id, _Pending())
            delta.token_ids.append(token)
            if logprob is not None:
                if delta.logprobs is None:
                    delta.logprobs = []
                delta.logprobs.append(logprob)
            self._ready.notify_all()

    def prompt_logprobs(self, request_id: str, entries: list[TokenLogprobs | None]) -> None:
        with self._ready:
            self._pending.setdefault(request_id, _Pending()).prompt_logprobs = entries

    def finish(
        self,
        request_id: str,
        reason: str,
        error: str | None = None,
        retryable: bool = False,
        num_cached_tokens: int | None = None,
    ) -> None:
        with self._ready:
            delta = self._pending.setdefault(request_id, _Pending())
            delta.finish_reason = reason
            delta.error = error
            delta.retryable = retryable
            delta.num_cached_tokens = num_cached_tokens
            self._ready.notify_all()

    def collect(self, timeout_s: float) -> dict[str, TokenBatch]:
        """Everything produced since the last call; waits up to ``timeout_s`` for something."""
        with self._ready:
            if not self._pending:
                self._ready.wait(timeout_s)
            pending, self._pending = self._pending, {}
        return {request_id: delta.batch() for request_id, delta in pending.items()}
