"""Tokens waiting to be collected by the router, batched per decode step.

The engine loop appends every sampled token; the router collects everything new for all
of its requests with one long-poll call, so streaming costs one Ray call per poll, not one
per token per request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Delta:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None  # with the first token, when asked
    finish_reason: str | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        return {
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "finish_reason": self.finish_reason,
            "error": self.error,
        }


class TokenOutbox:
    """Thread-safe: producers ``add``/``finish``; one consumer ``collect``s."""

    def __init__(self) -> None:
        self._pending: dict[str, Delta] = {}
        self._ready = threading.Condition()

    def add(self, request_id: str, token: int, logprob: dict | None = None) -> None:
        with self._ready:
            delta = self._pending.setdefault(request_id, Delta())
            delta.token_ids.append(token)
            if logprob is not None:
                if delta.logprobs is None:
                    delta.logprobs = []
                delta.logprobs.append(logprob)
            self._ready.notify_all()

    def prompt_logprobs(self, request_id: str, entries: list[dict | None]) -> None:
        with self._ready:
            self._pending.setdefault(request_id, Delta()).prompt_logprobs = entries

    def finish(self, request_id: str, reason: str, error: str | None = None) -> None:
        with self._ready:
            delta = self._pending.setdefault(request_id, Delta())
            delta.finish_reason = reason
            delta.error = error
            self._ready.notify_all()

    def collect(self, timeout_s: float) -> dict[str, dict]:
        """Everything produced since the last call; waits up to ``timeout_s`` for something."""
        with self._ready:
            if not self._pending:
                self._ready.wait(timeout_s)
            pending, self._pending = self._pending, {}
        return {request_id: delta.to_dict() for request_id, delta in pending.items()}
