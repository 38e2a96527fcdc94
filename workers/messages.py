"""The typed messages the worker actors return to the router (over Ray, pickled): what a
decode reservation, a prefill, a poll and a stats call give back. Frozen: a message is a fact, not state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.load import EngineLoad
from engine.sequence import TokenLogprobs
from kv_transfer.connector import KVHandle, ReceiverStats


@dataclass(frozen=True)
class Reservation:
    """Decode KV leased for a prompt (``DecodeWorker.reserve``): the handle its prefill
    streams the KV to, which the router carries unread. None for a colocated worker (nothing
    to stream) and where the decode replica prefills the prompt itself (``local``: its own
    prefix cache held all but a short remainder, cheaper to compute there than to send)."""

    kv: KVHandle | None = None
    local: bool = False
    cached_tokens: int = 0  # prompt tokens the decode replica's own prefix cache held


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
    transport: str = ""  # which (kv.transport) carried it

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
    # An "error" another attempt can get past: the sequence never started decoding here (its
    # KV did not arrive), so the router retries it rather than failing the request.
    retryable: bool = False
    # With the finish reason, from an engine that computed the prompt itself (colocated):
    # its tokens that the prefix cache served.
    num_cached_tokens: int | None = None


@dataclass(frozen=True)
class PrefillCounters:
    """A prefill worker's prefills since it started."""

    completed: int = 0
    failed: int = 0
    transfer_seconds: float = 0.0  # waiting for the KV's last frames after the first token


@dataclass(frozen=True)
class DecodeCounters:
    """A decode worker's transfers: waiting for their KV now, and received so far."""

    pending_transfers: int = 0  # reservations whose KV has not arrived
    pending_sequences: int = 0  # their sequences (a prompt with n choices counts n)
    leases: int = 0  # leases holding blocks (reserved or receiving)
    kv: ReceiverStats = field(default_factory=ReceiverStats)
    # Reuse across the split: prompts whose KV came from a prefill replica, the blocks of
    # theirs this replica's prefix cache held (not sent); prompts it prefilled itself, and
    # the tokens it computed for them; the most it would compute itself now (its measure).
    remote_prefills: int = 0
    reused_blocks: int = 0
    local_prefills: int = 0
    local_prefill_tokens: int = 0
    local_prefill_limit: int = 0


@dataclass(frozen=True)
class WorkerStats:
    """What a worker's ``stats()`` reports (the router refreshes them every second)."""

    name: str = ""
    load: EngineLoad = field(default_factory=EngineLoad)
    steps: int = 0  # engine steps run
    busy_s: float = 0.0  # time spent in them
    uptime_s: float = 0.0
    prefill: PrefillCounters | None = None  # prefill workers
    decode: DecodeCounters | None = None  # decode workers

    @property
    def unfinished(self) -> int:
        """Sequences it still holds: running, queued, or waiting for their KV."""
        pending = self.decode.pending_transfers if self.decode is not None else 0
        return self.load.running + self.load.waiting + pending

    def to_dict(self) -> dict:
        """A flat JSON view (for status output and benchmark records)."""
        view = {"name": self.name, **asdict(self.load)}
        view.update(steps=self.steps, busy_s=self.busy_s, uptime_s=self.uptime_s)
        if self.prefill is not None:
            view.update(asdict(self.prefill))
        if self.decode is not None:
            decode = asdict(self.decode)
            view.update({f"kv_{k}": v for k, v in decode.pop("kv").items()}, **decode)
        return view
