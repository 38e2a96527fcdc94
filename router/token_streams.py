"""Where each sequence's events reach its attempt: one queue per worker request id, fed by
one long-poll loop per decode replica (every request's new tokens in one Ray call), by the
prefill's result, and by failures (:class:`Retry`), the one channel through which an attempt
learns it must be retried or migrated.

Used from the router's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from engine.sequence import TokenLogprobs
from router.replicas import ReplicaSet
from workers.messages import TokenBatch

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 0.05


@dataclass(frozen=True)
class Retry:
    """This attempt cannot go on (its replica died or was removed, its prefill failed);
    another attempt can."""

    reason: str


@dataclass(frozen=True)
class PrefillToken:
    """A sequence's first token, as the prefill replica sampled it (its decode replica's
    stream starts with the same token, without logprobs)."""

    token_id: int
    logprob: TokenLogprobs | None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None


Event = Retry | PrefillToken | TokenBatch


class TokenStreams:
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self._queues: dict[str, asyncio.Queue[Event]] = {}  # worker request id → its events
        self._owner: dict[str, str] = {}  # worker request id → its decode replica
        self._pollers: dict[str, asyncio.Task] = {}

    def open(self, worker_rid: str) -> asyncio.Queue[Event]:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self._queues[worker_rid] = queue
        return queue

    def close(self, worker_rid: str) -> None:
        self._queues.pop(worker_rid, None)
        self._owner.pop(worker_rid, None)

    def owned_by(self, worker_rid: str, replica: str) -> None:
        """``worker_rid`` decodes on ``replica``: its failure retries the sequence."""
        self._owner[worker_rid] = replica

    def disown(self, worker_rid: str) -> None:
        self._owner.pop(worker_rid, None)

    def signal(self, worker_rid: str, event: Event) -> None:
        queue = self._queues.get(worker_rid)
        if queue is not None:
            queue.put_nowait(event)

    def retry_all_on(self, replica: str, reason: str) -> None:
        """Every sequence decoding on ``replica`` is retried elsewhere."""
        for worker_rid, owner in list(self._owner.items()):
            if owner == replica:
                self.signal(worker_rid, Retry(reason))

    # ---- polling ------------------------------------------------------------------------
    def start_polling(self, replica: str) -> None:
        self.stop_polling(replica)
        self._pollers[replica] = asyncio.create_task(self._poll_loop(replica))

    def stop_polling(self, replica: str) -> None:
        task = self._pollers.pop(replica, None)
        if task is not None:
            task.cancel()

    def pollers(self) -> list[asyncio.Task]:
        return list(self._pollers.values())

    async def _poll_loop(self, name: str) -> None:
        while True:
            replica = self.replicas.by_name.get(name)
            if replica is None:
                return
            try:
                batches: dict[str, TokenBatch] = await replica.handle.poll.remote(POLL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - the actor died or is unreachable
                logger.warning("polling %s failed: %s", name, error_message(err))
                replica.alive = False
                self.retry_all_on(name, f"{name} is unavailable ({type(err).__name__})")
                await asyncio.sleep(1.0)
                continue
            replica.alive = True
            for worker_rid, batch in batches.items():
                self.signal(worker_rid, batch)


def error_message(err: BaseException) -> str:
    """A Ray error's last line (the actor's own message), or the exception's type."""
    text = str(getattr(err, "cause", None) or err).strip()
    return text.splitlines()[-1] if text else type(err).__name__
