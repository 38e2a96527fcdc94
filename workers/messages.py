"""The typed messages the worker actors return to the router (over Ray, pickled): what a
decode reservation, a prefill and a poll give back. Frozen: a message is a fact, not state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import TokenLogprobs
from kv_transfer.connector import KVHandle


@dataclass(frozen=True)
class Reservation:
    """Decode KV leased for a prompt (``DecodeWorker.reserve``): the handle its prefill
    streams the KV to, which the router carries unread. None for a colocated worker (nothing
    to stream)."""

    kv: KVHandle | None = None


@dataclass(frozen=True)
class FirstToken:
    """A sequence's first token as the prefill worker sampled it."""

    token_id: int
    logprob: TokenLogprobs | None = None  # when its params asked for logprobs


@dataclass(frozen=True)
class PrefillTimes:
    """Where a prefill call's time went on its worker (router/timeline.py's worker part)."""

    wait_s: float = 0.0  # queued before its first chunk ran
    compute_s: float = 0.0  # its chunks, until the first token
    transfer_finish_s: float = 0.0  # the KV still in flight after that

    def to_dict(self) -> dict[str, float]:
        return {
            "wait_s": self.wait_s,
            "compute_s": self.compute_s,
            "transfer_finish_s": self.transfer_finish_s,
        }


@dataclass(frozen=True)
class PrefillResult:
    """A prefill's outcome (``PrefillWorker.prefill``): the request's first token, then each
    fork's (OpenAI's n), the prompt's logprobs when asked, and what the transfer moved."""

    first_tokens: tuple[FirstToken, ...]
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    num_cached_tokens: int = 0
    prefill_s: float = 0.0
    times: PrefillTimes = field(default_factory=PrefillTimes)
    transfer_bytes: int = 0  # KV payload bytes sent
    transfer_seconds: float = 0.0
    transferred: bool = True  # whether a KV transfer completed

    @property
    def first_token(self) -> int:
        return self.first_tokens[0].token_id


@dataclass(frozen=True)
class TokenBatch:
    """A sequence's tokens since the router's last poll (``poll``), the last one with a
    finish reason (and, for "error", the error)."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token when asked
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # with the first token
    finish_reason: str | None = None
    error: str | None = None
