"""The KV connector: the one interface between the pools. The router and the workers name no
transport; they hold a send side (prefill) or a receive side (decode) made by
:func:`transport` from the ``kv.transport`` option, and pass :class:`KVHandle`s between them.

One request's KV, in order:

1. The decode worker reserves a lease (kv_transfer.lease) and asks its receive side for the
   lease's handle (``KVRecvSide.handle_for``). The router carries the handle to the prefill
   worker unread.
2. The prefill worker's send side opens a stream for the handle (``KVSendSide.open``); the
   engine loop ships each finished layer's new blocks by id (``KVSendStream.send_layer``).
3. ``finish`` sends the first tokens and waits for the receiver's verdict; the receive side
   completes the lease (the blocks pass to the decode engine) or releases it. ``abort``
   instead ends the stream at once; the receiver releases the lease.

Tensor-parallel replicas: a transfer is one stream per (prefill rank, decode rank) pair that
shares KV heads (kv_transfer.sharding). Each rank has its own side over its own cache; rank
0's handle lists every decode rank's receiver (``KVHandle.receivers``), and each decode
rank's lease is a mirror of rank 0's (kv_transfer.lease_mirror). Only the gRPC transport
does this.

Block ownership: the lease table owns a lease's blocks from reserve to complete or release;
the receive side writes into them only through ``LeaseTable.write``, so nothing lands after a
lease is released or expired. The send side only reads the prefill cache's blocks: during
``send_layer`` (it copies what it keeps), or, for a stream that ``reads_in_place`` (NIXL: the
receiver READs them where they are, no copy), until the stream calls back
``on_sources_free``; the prefill worker keeps those blocks unchanged until then.

Errors: every transport failure a caller sees is a KVTransferError with a gRPC-style status
code name (``code``) and a message that says what went wrong.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import PagedKVCache
from kv_transfer.lease import Lease, LeaseTable
from kv_transfer.options import KVTransferOptions
from kv_transfer.sharding import RankReceiver


@dataclass(frozen=True)
class KVHandle:
    """Where one request's KV goes. Made by a receive side, read only by the send side of the
    same transport; everyone between carries it as it is (picklable)."""

    transport: str
    lease_id: str
    address: str  # the transport's own address of the receiver (rank 0's when sharded)
    # A tensor-parallel decode replica: every rank's receiver and KV heads (kv_transfer.
    # sharding); empty when one receiver at ``address`` holds all of them.
    receivers: tuple[RankReceiver, ...] = ()
    # The sequence's blocks before this one the receiver holds already (its prefix cache):
    # the transfer starts at it.
    first_block: int = 0


@dataclass(frozen=True)
class TransferResult:
    """What a completed transfer moved, as the send side saw it."""

    request_id: str
    lease_id: str
    payload_bytes: int  # bytes of K/V payload (and scales) sent
    kv_bytes: int  # bytes the same tokens occupy in the sender's cache dtype
    num_frames: int  # all frames, handshake and end included
    seconds: float  # open() to the receiver's answer


@dataclass(frozen=True)
class ReceiverStats:
    """A receive side's counters since it started."""

    bytes_received: int = 0  # payload bytes of accepted frames
    transfers_completed: int = 0
    transfers_failed: int = 0
    seconds: float = 0.0  # wall time spent in transfers (completed or failed)
    data_channel_transfers: int = 0  # gRPC: transfers whose kv frames took the data channel


class KVSendStream(ABC):
    """One request's transfer. ``send_layer`` is called from the prefill engine's thread
    (the layer hook), ``finish``/``abort`` from the thread that waits for the prefill; never
    two at once."""

    transport: str  # the transport that carries it
    # True: the blocks given to ``send_layer`` are read where they are after it returned; the
    # caller keeps them unchanged until the ``on_sources_free`` callback.
    reads_in_place: bool = False

    @abstractmethod
    def send_layer(self, layer: int, block_ids: torch.Tensor, first_block: int = 0) -> None:
        """Ship sequence blocks ``[first_block, first_block + len(block_ids))`` of one layer,
        read from the cache blocks ``block_ids`` (int64, on the cache's device). Each layer's
        blocks go in order, each once. May block for backpressure; returns once the cache may
        be overwritten (unless ``reads_in_place``). Raises KVTransferError when the receiver
        has refused the stream."""

    def send_layers(
        self, first_layer: int, layer_count: int, block_ids: torch.Tensor, first_block: int = 0
    ) -> None:
        """``send_layer`` for layers ``[first_layer, first_layer + layer_count)`` in turn, the
        same blocks of each (the layers a prefill step ends with, shipped together). Same
        contract; a transport may send them as fewer, larger frames."""
        for layer in range(first_layer, first_layer + layer_count):
            self.send_layer(layer, block_ids, first_block)

    @abstractmethod
    def finish(self, first_token: int, fork_tokens: Sequence[int] = ()) -> TransferResult:
        """Send the first token (and the forks') and wait for the receiver to take the KV.
        Raises KVTransferError with the receiver's reason when it refused; the lease is then
        released."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """End the stream now; the receiver releases the lease as soon as it learns of it (a
        stream aborted before its first frame arrived leaves the lease to its deadline, or to
        the decode worker's cancel). Idempotent."""

    def on_sources_free(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once, when nothing reads the blocks given to ``send_layer`` any
        more: after ``finish`` returned, or after ``abort`` once the receiver's reads under
        way ended. From whichever thread sees it (maybe this one, at once), with none of the
        stream's locks held. A stream that copies in ``send_layer`` calls it at once."""
        callback()


class KVSendSide(ABC):
    """A prefill worker's end of a transport: one per worker, constructed with its cache,
    shared by every request (``open`` from any thread)."""

    transport: str  # the name it is registered under

    @abstractmethod
    def open(self, handle: KVHandle, request_id: str, num_tokens: int) -> KVSendStream:
        """Start the transfer of a prompt of ``num_tokens`` tokens to ``handle``'s lease."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; streams still open fail."""


class KVRecvSide(ABC):
    """A decode worker's end of a transport: it writes arriving KV into leased blocks through
    the lease table and completes the lease when a transfer is whole. Its threads are its
    own; it takes the engine lock only through the lease table."""

    @abstractmethod
    def start(self, cache: PagedKVCache, leases: LeaseTable) -> None:
        """Start accepting transfers into ``cache`` under ``leases``."""

    @abstractmethod
    def handle_for(self, lease: Lease) -> KVHandle:
        """The handle a send side needs to fill ``lease``."""

    @abstractmethod
    def stats(self) -> ReceiverStats: ...

    @abstractmethod
    def stop(self) -> None:
        """Stop; transfers in flight fail and their leases are released."""


@dataclass(frozen=True)
class Transport:
    """A registered transport: how to make each side of it from a worker's KV options."""

    name: str
    send_side: Callable[[PagedKVCache, dict, KVTransferOptions], KVSendSide]  # cache, fp, options
    recv_side: Callable[[dict, KVTransferOptions], KVRecvSide]  # model fingerprint, options


_TRANSPORTS: dict[str, Transport] = {}


def register_transport(entry: Transport) -> None:
    if entry.name in _TRANSPORTS:
        raise ValueError(f"a KV transport named {entry.name!r} is already registered")
    _TRANSPORTS[entry.name] = entry


def transport_names() -> tuple[str, ...]:
    _load_builtin()
    return tuple(sorted(_TRANSPORTS))


def transport(name: str) -> Transport:
    """The transport registered as ``name``; ValueError naming the known ones otherwise."""
    _load_builtin()
    try:
        return _TRANSPORTS[name]
    except KeyError:
        known = ", ".join(transport_names())
        raise ValueError(f"unknown KV transport {name!r} (known: {known})") from None


def _load_builtin() -> None:
    import kv_transfer.grpc_transport  # noqa: F401  (registers "grpc")
    import kv_transfer.nixl_transport  # noqa: F401  (registers "nixl"; needs the nixl extra to run)
