"""Leases: cache blocks a decode worker reserves for one incoming KV transfer, with a deadline.

Life of a lease: ``reserve`` (router asks the decode worker before prefill starts) →
``begin`` (the receiver accepts a handshake naming it) → ``complete`` (every layer arrived;
the blocks now belong to whoever ``on_complete`` hands them to) or ``release`` (refused,
broken stream, aborted, or past its deadline: the blocks go back to the pool).

Thread-safety: every method takes ``lock``, the same RLock that guards the decode worker's
BlockManager (which is not thread-safe itself). The receiver copies a frame into the cache
through :meth:`LeaseTable.write`, under that lock and only while the lease is still its own, so
a lease released concurrently (sweeper, abort) can never have its blocks written after they
went back to the pool.
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
    release_reason: str | None = field(default=None, repr=False)


class LeaseTable:
    """The decode worker's leases. Owns the reserved blocks until complete or released."""

    def __init__(
        self,
        block_manager,
        lock: threading.RLock,
        default_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_complete: Callable[[Lease], None] | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.lock = lock
        self.default_timeout_s = default_timeout_s
        self.clock = clock
        self.on_complete = on_complete
        self._leases: dict[str, Lease] = {}  # reserved or receiving: blocks owned here
        self._ended: OrderedDict[str, Lease] = OrderedDict()  # complete or released, recent

    # ---- router / decode worker side --------------------------------------------------
    def reserve(self, request_id: str, num_tokens: int, timeout_s: float | None = None) -> Lease:
        """Reserve ``ceil(num_tokens / block_size)`` blocks. Raises NoCapacityError."""
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        with self.lock:
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
            self._leases[lease.lease_id] = lease
            return lease

    def release(self, lease_id: str, reason: str) -> bool:
        """Free the lease's blocks unless it is complete. Idempotent; True if it freed them."""
        with self.lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            self.block_manager.free(list(lease.block_ids))
            lease.state = RELEASED
            lease.release_reason = reason
            self._remember(lease)
            return True

    def expire(self) -> list[str]:
        """Release every unfinished lease past its deadline; returns their ids. Called
        periodically by the receiver's sweeper thread."""
        with self.lock:
            now = self.clock()
            late = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
            for lease_id in late:
                self.release(lease_id, "expired")
            return late

    def active(self) -> int:
        """Leases holding blocks (reserved or receiving)."""
        with self.lock:
            return len(self._leases)

    def get(self, lease_id: str) -> Lease:
        """The lease, if it is live or complete. Raises LeaseError (NOT_FOUND) when it is
        unknown, released, or expired (an expired one is released on the spot)."""
        with self.lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                if lease.deadline <= self.clock():
                    self.release(lease_id, "expired")
                    raise LeaseError(f"lease {lease_id} expired")
                return lease
            ended = self._ended.get(lease_id)
            if ended is None:
                raise LeaseError(f"unknown lease {lease_id}")
            if ended.state == COMPLETE:
                return ended
            raise LeaseError(f"lease {lease_id} was released ({ended.release_reason})")

    # ---- receiver side ----------------------------------------------------------------
    def begin(self, lease_id: str, request_id: str) -> Lease:
        """Attach a transfer to a reserved lease (reserved → receiving). Raises LeaseError
        (unknown/expired) or LeaseStateError (another request's, or already attached)."""
        with self.lock:
            lease = self.get(lease_id)
            if lease.request_id != request_id:
                raise LeaseStateError(
                    f"lease {lease_id} belongs to request {lease.request_id!r}, not {request_id!r}"
                )
            if lease.state != RESERVED:
                raise LeaseStateError(f"lease {lease_id} is {lease.state}, not reserved")
            lease.state = RECEIVING
            return lease

    def write(self, lease: Lease, fn: Callable[..., T], *args) -> T:
        """Run ``fn(*args)`` (a copy into the lease's blocks) under the lock, only if the lease is
        still receiving and inside its deadline. Raises LeaseExpiredError / LeaseError."""
        with self.lock:
            self._check_receiving(lease)
            return fn(*args)

    def complete(self, lease: Lease, first_token: int) -> Lease:
        """receiving → complete: the table stops owning the blocks; ``on_complete(lease)``
        (called without the lock held) takes them over, e.g. to start decoding."""
        with self.lock:
            self._check_receiving(lease)
            del self._leases[lease.lease_id]
            lease.state = COMPLETE
            lease.first_token = first_token
            self._remember(lease)
        if self.on_complete is not None:
            self.on_complete(lease)
        return lease

    # ---- internals --------------------------------------------------------------------
    def _check_receiving(self, lease: Lease) -> None:
        if self._leases.get(lease.lease_id) is not lease:
            raise LeaseExpiredError(
                f"lease {lease.lease_id} was released during the transfer ({lease.release_reason})"
            )
        if lease.state != RECEIVING:
            raise LeaseStateError(f"lease {lease.lease_id} is {lease.state}, not receiving")
        if lease.deadline <= self.clock():
            self.release(lease.lease_id, "expired")
            raise LeaseExpiredError(f"lease {lease.lease_id} expired during the transfer")

    def _remember(self, lease: Lease) -> None:
        self._ended[lease.lease_id] = lease
        while len(self._ended) > _HISTORY:
            self._ended.popitem(last=False)
