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

Tensor parallelism: a decode replica of tp b has a lease table per rank, each over that
rank's cache and KV heads. Rank 0's table owns the blocks (its BlockManager); its ``peers``
mirror every lease on the other ranks (kv_transfer.lease_mirror). A transfer is then several
streams, each filling some of a rank's heads (``begin`` / ``complete`` name them); rank 0's
lease completes when its own heads are filled, every peer rank reported its heads filled
(``peer_filled``) and the first token has come. Released, its blocks return to the pool
only once no local copy is in flight *and* every peer confirmed the same of its own
(``peer_drained``): nothing lands on any rank after a lease is released.
"""

from __future__ import annotations

import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
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
    # Blocks [0, first_block) came from this worker's own prefix cache: a transfer fills
    # only the rest.
    first_block: int = 0
    state: str = RESERVED  # reserved | receiving | complete | released
    first_token: int | None = None
    fork_tokens: tuple[int, ...] = ()  # the first tokens of the prompt's forks, if any
    release_reason: str | None = field(default=None, repr=False)
    writers: int = field(default=0, repr=False)  # copies into the blocks in flight
    # CUDA: recorded on the receiver's copy stream after the last copy; whoever takes the
    # blocks over makes its own stream wait on it before reading them.
    ready_event: object | None = field(default=None, repr=False)
    blocks_owed: bool = field(default=False, repr=False)  # released: free when writers hit 0
    # The KV heads [start, stop) of this rank's cache, which the lease's streams fill (set by
    # the first stream); the heads of streams attached so far, and of those that ended whole.
    heads: tuple[int, int] | None = field(default=None, repr=False)
    heads_claimed: set[int] = field(default_factory=set, repr=False)
    heads_filled: set[int] = field(default_factory=set, repr=False)
    peers_pending: set[int] = field(default_factory=set, repr=False)  # peer ranks not filled
    drains_pending: set[int] = field(default_factory=set, repr=False)  # released: unconfirmed


class LeasePeers(ABC):
    """The other ranks of a tensor-parallel decode replica, as rank 0's lease table sees
    them. Called with the engine lock held (so messages are ordered with the steps)."""

    ranks: tuple[int, ...]

    @abstractmethod
    def open(self, lease: Lease) -> None:
        """Mirror a just reserved lease on every peer rank."""

    @abstractmethod
    def close(self, lease_id: str, reason: str) -> None:
        """Release the lease on every peer rank; each answers ``peer_drained`` once no copy
        into its blocks is in flight."""


class LeaseTable:
    """The decode worker's leases. Owns the reserved blocks until complete or released."""

    needs_first_token = True  # a peer rank's mirror table completes without it

    def __init__(
        self,
        block_manager,
        engine_lock: threading.RLock,
        default_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_complete: Callable[[Lease], None] | None = None,
        on_release: Callable[[Lease], None] | None = None,
        peers: LeasePeers | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.peers = peers
        self.engine_lock = engine_lock
        self.default_timeout_s = default_timeout_s
        self.clock = clock
        self.on_complete = on_complete
        self.on_release = on_release
        self._state = threading.Lock()
        self._leases: dict[str, Lease] = {}  # reserved or receiving: blocks owned here
        self._ended: OrderedDict[str, Lease] = OrderedDict()  # complete or released, recent

    # ---- router / decode worker side --------------------------------------------------
    def reserve(
        self,
        request_id: str,
        num_tokens: int,
        timeout_s: float | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> Lease:
        """Reserve ``ceil(num_tokens / block_size)`` blocks. With the prompt's ``token_ids``,
        the leading blocks this cache already holds are taken from its prefix cache (never
        the one holding the last token) and the lease's ``first_block`` says how many: the
        transfer fills only the rest. Raises NoCapacityError."""
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        if token_ids is not None and len(token_ids) != num_tokens:
            raise ValueError(f"{len(token_ids)} token ids for a lease of {num_tokens} tokens")
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        bm = self.block_manager
        with self.engine_lock:
            try:
                if token_ids is not None:  # raises EngineError where the pool cannot hold it
                    block_ids, cached_tokens = bm.allocate(token_ids)
                else:
                    needed, free = bm.blocks_needed(num_tokens), bm.num_free_blocks
                    if needed > free:
                        raise NoCapacityError(
                            f"KV cache has {free} free blocks; request {request_id!r} needs "
                            f"{needed}"
                        )
                    block_ids, cached_tokens = bm.reserve(needed), 0
            except EngineError as err:
                raise NoCapacityError(str(err)) from None
            lease = Lease(
                lease_id=uuid.uuid4().hex,
                request_id=request_id,
                block_ids=block_ids,
                num_tokens=num_tokens,
                deadline=self.clock() + timeout,
                first_block=cached_tokens // bm.block_size,
            )
            if self.peers is not None:
                lease.peers_pending = set(self.peers.ranks)
            with self._state:
                self._leases[lease.lease_id] = lease
            if self.peers is not None:
                self.peers.open(lease)
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
            if self.peers is not None:
                lease.drains_pending = set(self.peers.ranks)
            if lease.writers or lease.drains_pending:
                lease.blocks_owed = True  # the last copy (here or on a peer) gives them back
            else:
                self._give_back(lease)
        if self.peers is not None:
            with self.engine_lock:
                self.peers.close(lease_id, reason)
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

    def peer_filled(self, lease_id: str, rank: int) -> None:
        """A peer rank has all of its heads of the lease (rank 0's table; from its listener)."""
        with self._state:
            lease = self._leases.get(lease_id)
            if lease is None:
                return  # released meanwhile: its peers are being closed
            lease.peers_pending.discard(rank)
            whole = self._whole(lease)
        if whole and self.on_complete is not None:
            self.on_complete(lease)

    def peer_drained(self, lease_id: str, rank: int) -> None:
        """A peer rank confirmed that nothing more lands in the released lease's blocks."""
        with self.engine_lock, self._state:
            lease = self._ended.get(lease_id)
            if lease is None or lease.state != RELEASED:
                return
            lease.drains_pending.discard(rank)
            if self._owed_now(lease):
                self._give_back(lease)

    # ---- receiver side ----------------------------------------------------------------
    def begin(
        self,
        lease_id: str,
        request_id: str,
        heads: tuple[int, int] | None = None,
        cache_heads: tuple[int, int] | None = None,
    ) -> Lease:
        """Attach a stream to a lease (reserved → receiving). ``heads``: the KV heads the
        stream fills, of ``cache_heads`` (this rank's); by default all of them, in one
        stream. Raises LeaseError (unknown/expired) or LeaseStateError (another request's,
        complete, or those heads already taken by another stream)."""
        lease = self.get(lease_id)
        with self._state:
            if lease.request_id != request_id:
                raise LeaseStateError(
                    f"lease {lease_id} belongs to request {lease.request_id!r}, not {request_id!r}"
                )
            if heads is None:  # one stream fills the whole lease
                if lease.state != RESERVED:
                    raise LeaseStateError(f"lease {lease_id} is {lease.state}, not reserved")
                lease.heads = heads = lease.heads or (0, 1)
            elif lease.state not in (RESERVED, RECEIVING):
                raise LeaseStateError(f"lease {lease_id} is {lease.state}, not reserved")
            if lease.heads is None:
                lease.heads = cache_heads or heads
            wanted = set(range(*heads))
            if not wanted <= set(range(*lease.heads)) or wanted & lease.heads_claimed:
                taken = sorted(lease.heads_claimed)
                raise LeaseStateError(
                    f"lease {lease_id}: KV heads {list(heads)} are not free on this rank "
                    f"(it holds {list(lease.heads)}, streams already fill {taken})"
                )
            lease.heads_claimed |= wanted
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
                with self.engine_lock, self._state:
                    if self._owed_now(lease):
                        self._give_back(lease)

    def complete(
        self,
        lease: Lease,
        first_token: int | None,
        fork_tokens: tuple[int, ...] = (),
        heads: tuple[int, int] | None = None,
    ) -> Lease:
        """A stream ended whole, filling ``heads`` (default: all the lease's). Once every
        head here (and on every peer rank) is filled and the first token has come:
        receiving → complete, the table stops owning the blocks, and ``on_complete(lease)``
        (called without any lock held) takes them over, e.g. to start decoding."""
        with self._state:
            problem = self._receiving_problem(lease)
            if problem is None:
                lease.heads_filled |= set(range(*(heads or lease.heads)))
                if first_token is not None:
                    lease.first_token = first_token
                    lease.fork_tokens = tuple(fork_tokens)
                whole = self._whole(lease)
        if problem is not None:
            self._refuse(lease, problem)
        if whole and self.on_complete is not None:
            self.on_complete(lease)
        return lease

    def _whole(self, lease: Lease) -> bool:
        """Complete the lease if nothing is missing (state lock held); True if it did."""
        if lease.state != RECEIVING or lease.peers_pending:
            return False
        if lease.heads is None or lease.heads_filled != set(range(*lease.heads)):
            return False
        if self.needs_first_token and lease.first_token is None:
            return False
        del self._leases[lease.lease_id]
        lease.state = COMPLETE
        self._remember(lease)
        return True

    # ---- internals (the state lock held) ------------------------------------------------
    def _owed_now(self, lease: Lease) -> bool:
        """A released lease's blocks may go back now (no copy in flight here or on a peer);
        True once, for the caller to give them back (engine and state locks held)."""
        if lease.blocks_owed and not lease.writers and not lease.drains_pending:
            lease.blocks_owed = False
            return True
        return False

    def _give_back(self, lease: Lease) -> None:
        """The released lease's blocks back to the pool (engine and state locks held)."""
        self.block_manager.free(list(lease.block_ids))

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
