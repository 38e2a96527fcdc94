"""Leases across the ranks of a tensor-parallel decode replica.

Rank 0 (the decode worker actor) reserves a lease's blocks; every rank's cache has the same
block ids, so each other rank keeps a mirror of the lease over its own KV heads, which its
own KV receiver fills (kv_transfer.sharding: each decode rank receives exactly its heads).

Messages, over the replica's rank channel (engine.tp_worker ToRank / FromRank):
- rank 0 → ranks: ``OpenLease`` at reserve, ``CloseLease`` at release (both sent with the
  engine lock held, so in order with each other and with the steps);
- a rank → rank 0: ``LeaseFilled`` (its heads arrived whole), ``LeaseFailed`` (its stream
  failed or its copy of the lease expired: rank 0 releases the lease) and ``LeaseDrained``
  (the answer to ``CloseLease``, sent once no copy into its blocks is in flight).

So a released lease's blocks go back to rank 0's pool only after every rank has drained:
nothing is written on any rank after release. A completed lease is complete on every rank
(each reported ``LeaseFilled`` and refuses further writes), so the blocks pass to the
engine with nothing in flight anywhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kv_transfer.lease import COMPLETE, RELEASED, Lease, LeasePeers, LeaseTable

ADOPT_WAIT_S = 10.0  # a stream may reach a rank before its OpenLease does: wait this long


@dataclass(frozen=True)
class OpenLease:
    lease_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    timeout_s: float
    first_block: int = 0  # blocks before it: rank 0's prefix cache had them (every rank's)


@dataclass(frozen=True)
class CloseLease:
    lease_id: str
    reason: str


@dataclass(frozen=True)
class LeaseFilled:
    lease_id: str


@dataclass(frozen=True)
class LeaseFailed:
    lease_id: str
    reason: str


@dataclass(frozen=True)
class LeaseDrained:
    lease_id: str


class RankLeases(LeasePeers):
    """Rank 0's view of the other ranks: ``send`` hands a message to all of them (the
    engine's ``send_to_ranks``)."""

    def __init__(self, ranks: tuple[int, ...], send: Callable[[Any], None]) -> None:
        self.ranks = ranks
        self._send = send

    def open(self, lease: Lease) -> None:
        timeout = max(0.0, lease.deadline - time.monotonic())
        self._send(
            OpenLease(
                lease.lease_id,
                lease.request_id,
                tuple(lease.block_ids),
                lease.num_tokens,
                timeout,
                lease.first_block,
            )
        )

    def close(self, lease_id: str, reason: str) -> None:
        self._send(CloseLease(lease_id, reason))

    @staticmethod
    def deliver(leases: LeaseTable, rank: int, message: Any) -> None:
        """Apply a rank's message to rank 0's table (on the listener thread)."""
        if isinstance(message, LeaseFilled):
            leases.peer_filled(message.lease_id, rank)
        elif isinstance(message, LeaseDrained):
            leases.peer_drained(message.lease_id, rank)
        elif isinstance(message, LeaseFailed):
            leases.release(message.lease_id, f"rank {rank}: {message.reason}")
        else:
            raise TypeError(f"unexpected lease message from rank {rank}: {message!r}")


class MirrorLeaseTable(LeaseTable):
    """A worker rank's copies of rank 0's leases. It owns no blocks (rank 0's BlockManager
    does): "giving them back" means telling rank 0 they are safe to reuse."""

    needs_first_token = False  # rank 0's stream carries it

    def __init__(self, notify: Callable[[Any], None], clock: Callable[[], float] = time.monotonic):
        super().__init__(
            None,
            threading.RLock(),
            clock=clock,
            on_complete=lambda lease: notify(LeaseFilled(lease.lease_id)),
            on_release=self._released,
        )
        self._notify = notify
        self._adopted = threading.Condition(self._state)
        self._closed_by_owner: set[str] = set()  # released by rank 0 (no LeaseFailed back)
        self._awaiting_drain: set[str] = set()  # rank 0 waits for LeaseDrained
        self._given_back: set[str] = set()  # released here, no copy in flight any more

    def adopt(self, message: OpenLease) -> None:
        """Mirror a lease rank 0 reserved (from its OpenLease)."""
        lease = Lease(
            lease_id=message.lease_id,
            request_id=message.request_id,
            block_ids=list(message.block_ids),
            num_tokens=message.num_tokens,
            deadline=self.clock() + message.timeout_s,
            first_block=message.first_block,
        )
        with self._adopted:
            self._leases[lease.lease_id] = lease
            self._adopted.notify_all()

    def close(self, message: CloseLease) -> None:
        """Rank 0 released the lease: release it here; ``LeaseDrained`` follows once no copy
        is in flight (at once if none is, or if the lease is already over here)."""
        lease_id = message.lease_id
        with self._state:
            live = lease_id in self._leases
            ended = self._ended.get(lease_id)
            if live:
                self._closed_by_owner.add(lease_id)
                self._awaiting_drain.add(lease_id)
            elif ended is not None and ended.state == RELEASED and lease_id not in self._given_back:
                self._awaiting_drain.add(lease_id)  # released here, a copy still in flight
                return
            else:
                self._given_back.discard(lease_id)
        if not live:
            self._notify(LeaseDrained(lease_id))
        elif not self.release(lease_id, message.reason):  # it ended meanwhile
            with self._state:
                ended = self._ended.get(lease_id)
                complete = ended is not None and ended.state == COMPLETE
                if complete:
                    self._awaiting_drain.discard(lease_id)
            if complete:
                self._notify(LeaseDrained(lease_id))

    def get(self, lease_id: str) -> Lease:
        with self._adopted:  # a stream may be here before the lease's OpenLease
            self._adopted.wait_for(
                lambda: lease_id in self._leases or lease_id in self._ended, ADOPT_WAIT_S
            )
        return super().get(lease_id)

    def _give_back(self, lease: Lease) -> None:  # state lock held (notify takes no lock of ours)
        if lease.lease_id in self._awaiting_drain:
            self._awaiting_drain.discard(lease.lease_id)
            self._notify(LeaseDrained(lease.lease_id))
        else:
            self._given_back.add(lease.lease_id)  # released here: drained when rank 0 asks

    def _released(self, lease: Lease) -> None:
        """Released here (not by rank 0): tell rank 0, which releases it everywhere."""
        with self._state:
            by_owner = lease.lease_id in self._closed_by_owner
            self._closed_by_owner.discard(lease.lease_id)
        if not by_owner:
            self._notify(LeaseFailed(lease.lease_id, lease.release_reason or "released"))
