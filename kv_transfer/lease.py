"""Leases: cache blocks a decode worker reserves for one incoming KV transfer, with a deadline.

Life of a lease: ``reserve`` (router asks the decode worker before prefill starts) →
``begin`` (the receiver accepts a handshake naming it) → ``complete`` (every layer arrived;
the blocks now belong to whoever ``on_complete`` hands them to) or ``release`` (refused,
broken stream, aborted, or past its deadline: the blocks go back to the pool, and
``on_release`` tells the owner, whichever thread released it).

Locks: ``engine_lock`` is the decode worker's engine lock, which guards its BlockManager
(not thread-safe itself) and which the engine loop holds for a whole step; it is taken only
to take or give back blocks (reserve, release). Lease state lives under the table's own small
lock. A frame's copy into the cache (:meth:`LeaseTable.write`) holds neither: a lease's blocks
belong to its transfer alone until it completes, so KV lands at wire speed however busy
decode is. The guarantee that nothing is written after a lease is released or expired holds
by construction: a copy starts only while the lease is receiving and inside its deadline, and
a lease released while a copy is in flight gives its blocks back only when that copy ends.
Lock order: engine lock, then the state lock; never the other way round.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from engine.errors import EngineError
from kv_transfer.errors import (
    LeaseError,
    LeaseExpiredError,
    LeaseStateError,
    NoCapacityError,
)

__all__ = ["Lease", "LeaseTable", "NoCapacityError"]

RESERVED = "reserved"
RECEIVING = "receiving"
COMPLETE = "complete"
RELEASED = "released"

_HISTORY = 4096  # ended leases remembered, for clear error messages ("expired" vs "unknown")
T = TypeVar("T")


@dataclass
class Lease:
    """Blocks held for one request's incoming KV. Mutated only under the table's lock."""

    lease_id: str
    request_id: str
    block_ids: list[int]  # wire block i of the sequence → cache block block_ids[i]
    num_tokens: int
    deadline: float  # clock() time after which an unfinished lease is released
    state: str = RESERVED  # reserved | receiving | complete | released
    first_token: int | None = None
    fork_tokens: tuple[int, ...] = ()  # the first tokens of the prompt's forks, if any
    release_reason: str | None = field(default=None, repr=False)
    writers: int = field(default=0, repr=False)  # copies into the blocks in flight
    # CUDA: recorded on the receiver's copy stream after the last copy; whoever takes the
    # blocks over makes its own stream wait on it before reading them.
    ready_event: object | None = field(default=None, repr=False)
    blocks_owed: bool = field(default=False, repr=False)  # released: free when writers hit 0


class LeaseTable:
    """The decode worker's leases. Owns the reserved blocks until complete or released."""

    def __init__(
        self,
        block_manager,
        engine_lock: threading.RLock,
        default_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_complete: Callable[[Lease], None] | None = None,
        on_release: Callable[[Lease], None] | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.engine_lock = engine_lock
        self.default_timeout_s = default_timeout_s
        self.clock = clock
        self.on_complete = on_complete
        self.on_release = on_release
        self._state = threading.Lock()
        self._leases: dict[str, Lease] = {}  # reserved or receiving: blocks owned here
        self._ended: OrderedDict[str, Lease] = OrderedDict()  # complete or released, recent

    # ---- router / decode worker side --------------------------------------------------
    def reserve(self, request_id: str, num_tokens: int, timeout_s: float | None = None) -> Lease:
        """Reserve ``ceil(num_tokens / block_size)`` blocks. Raises NoCapacityError."""
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        with self.engine_lock:
            needed = self.block_manager.blocks_needed(num_tokens)
            free = self.block_manager.num_free_blocks
            if needed > free:
                raise NoCapacityError(
                    f"KV cache has {free} free blocks; request {request_id!r} needs {needed}"
                )
            try:
                block_ids = self.block_manager.reserve(needed)
            except EngineError as err:
                raise NoCapacityError(str(err)) from None
            lease = Lease(
                lease_id=uuid.uuid4().hex,
                request_id=request_id,
                block_ids=block_ids,
                num_tokens=num_tokens,
                deadline=self.clock() + timeout,
            )
            with self._state:
                self._leases[lease.lease_id] = lease
            return lease

    def release(self, lease_id: str, reason: str) -> bool:
        """Free the lease's blocks unless it is complete (once no copy into them is in
        flight), then call ``on_release(lease)`` with no lock of the table held. Idempotent;
        True if this call released it."""
        with self.engine_lock, self._state:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            lease.state = RELEASED
            lease.release_reason = reason
            self._remember(lease)
            if lease.writers:
                lease.blocks_owed = True  # the last copy in flight gives them back
            else:
                self.block_manager.free(list(lease.block_ids))
        if self.on_release is not None:
            self.on_release(lease)
        return True

    def expire(self) -> list[str]:
        """Release every unfinished lease past its deadline; returns their ids. Called
        periodically by the receiver's sweeper thread."""
        with self._state:
            now = self.clock()
            late = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
        return [lease_id for lease_id in late if self.release(lease_id, "expired")]

    def active(self) -> int:
        """Leases holding blocks (reserved or receiving)."""
        with self._state:
            return len(self._leases)

    def get(self, lease_id: str) -> Lease:
        """The lease, if it is live or complete. Raises LeaseError (NOT_FOUND) when it is
        unknown, released, or expired (an expired one is released on the spot)."""
        with self._state:
            lease = self._leases.get(lease_id)
            expired = lease is not None and lease.deadline <= self.clock()
            if lease is not None and not expired:
                return lease
            ended = self._ended.get(lease_id)
        if expired:
            self.release(lease_id, "expired")
            raise LeaseError(f"lease {lease_id} expired")
        if ended is None:
            raise LeaseError(f"unknown lease {lease_id}")
        if ended.state == COMPLETE:
            return ended
        raise LeaseError(f"lease {lease_id} was released ({ended.release_reason})")

    # ---- receiver side ----------------------------------------------------------------
    def begin(self, lease_id: str, request_id: str) -> Lease:
        """Attach a transfer to a reserved lease (reserved → receiving). Raises LeaseError
        (unknown/expired) or LeaseStateError (another request's, or already attached)."""
        lease = self.get(lease_id)
        with self._state:
            if lease.request_id != request_id:
                raise LeaseStateError(
                    f"lease {lease_id} belongs to request {lease.request_id!r}, not {request_id!r}"
                )
            if lease.state != RESERVED:
                raise LeaseStateError(f"lease {lease_id} is {lease.state}, not reserved")
            lease.state = RECEIVING
            return lease

    def write(self, lease: Lease, fn: Callable[..., T], *args) -> T:
        """Run ``fn(*args)`` (a copy into the lease's blocks) if the lease is still receiving
        and inside its deadline, holding no lock while it runs. Raises LeaseExpiredError /
        LeaseError; the blocks stay out of the pool until the copy has ended."""
        with self._state:
            problem = self._receiving_problem(lease)
            if problem is None:
                lease.writers += 1
        if problem is not None:
            self._refuse(lease, problem)
        try:
            return fn(*args)
        finally:
            with self._state:
                lease.writers -= 1
                owed = lease.blocks_owed and lease.writers == 0
                if owed:
                    lease.blocks_owed = False
            if owed:
                with self.engine_lock:
                    self.block_manager.free(list(lease.block_ids))

    def complete(self, lease: Lease, first_token: int, fork_tokens: tuple[int, ...] = ()) -> Lease:
        """receiving → complete: the table stops owning the blocks; ``on_complete(lease)``
        (called without any lock held) takes them over, e.g. to start decoding."""
        with self._state:
            problem = self._receiving_problem(lease)
            if problem is None:
                del self._leases[lease.lease_id]
                lease.state = COMPLETE
                lease.first_token = first_token
                lease.fork_tokens = tuple(fork_tokens)
                self._remember(lease)
        if problem is not None:
            self._refuse(lease, problem)
        if self.on_complete is not None:
            self.on_complete(lease)
        return lease

    # ---- internals (the state lock held) ------------------------------------------------
    def _receiving_problem(self, lease: Lease) -> str | None:
        if self._leases.get(lease.lease_id) is not lease:
            return "released"
        if lease.state != RECEIVING:
            return "state"
        if lease.deadline <= self.clock():
            return "expired"
        return None

    def _refuse(self, lease: Lease, problem: str) -> None:
        """Raise the error for a lease a transfer may no longer write (no lock held)."""
        if problem == "released":
            raise LeaseExpiredError(
                f"lease {lease.lease_id} was released during the transfer ({lease.release_reason})"
            )
        if problem == "state":
            raise LeaseStateError(f"lease {lease.lease_id} is {lease.state}, not receiving")
        self.release(lease.lease_id, "expired")
        raise LeaseExpiredError(f"lease {lease.lease_id} expired during the transfer")

    def _remember(self, lease: Lease) -> None:
        self._ended[lease.lease_id] = lease
        while len(self._ended) > _HISTORY:
            self._ended.popitem(last=False)
