"""The NIXL transport (registered as "nixl"; needs the nixl extra): the blocks move by NIXL
(UCX) READs, gRPC keeps the token-checked handshake, the compatibility check, integrity and
the first token.

A transfer: the prefill side copies each layer's new blocks out of its cache into a slot of
its registered staging memory and sends a ``kv_ready`` frame (kv_transfer.frames) over the
gRPC stream, the handshake of which carried its agent metadata. The decode side READs the
slot straight into the lease's blocks, checks the CRC32C the frame gave, and its READ leaves a
notification that frees the slot. Pull, not push: every byte that lands in the decode cache
lands by the decode side's own READ, inside ``LeaseTable.write``, so nothing is written after
a lease is released or expired (a late one-sided WRITE into reused blocks cannot happen by
construction), and a sender sees no decode memory at all.

Trust: NIXL does not authenticate peers. The receiver adds a sender's agent only after the
gRPC handshake passed the token check; the sender's staging memory is all it exposes. As with
the anchors, run it on a private cluster network; TLS and the token still cover gRPC.
The caches on both sides must have the same dtype (pages move as they are: fp8 pages with
their scales, or the model dtype); ``kv.wire_dtype`` applies to the gRPC transport only. CPU
caches only for now: on CUDA, READs into device memory and a device-side checksum are to come.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable

import crc32c
import torch

from engine.kv_cache import PagedKVCache, block_runs
from kv_transfer import frames
from kv_transfer.codec import dtype_name
from kv_transfer.connector import (
    KVHandle,
    KVRecvSide,
    KVSendSide,
    TransferResult,
    Transport,
    register_transport,
    transport,
)
from kv_transfer.errors import FrameError, HandshakeError, KVTransferError
from kv_transfer.grpc_transport import GrpcRecvSide, GrpcSendSide, KVSendStream
from kv_transfer.nixl_agent import NixlAgent, nixl_unavailable
from kv_transfer.options import KVTransferOptions
from kv_transfer.sender import TransferStream

NAME = "nixl"
SLOT_BYTES = 16 * 1024 * 1024  # a staging slot (4 MiB ran 0.84 GB/s here, 16 MiB 1.2-1.3)
SLOTS = 8  # staged chunks a send side holds at once (128 MiB; backpressure past them)
READ_TIMEOUT_S = 30.0
# After an abort, its slots stay unused and the agent progressing this long: a receiver's READ
# of them may be under way, and it ends (done, or cancelled once the receiver sees the abort).
ABORT_DRAIN_S = 2.0


def _cpu_only(cache: PagedKVCache) -> None:
    if cache.device.type != "cpu":
        raise KVTransferError(
            f"the NIXL transport takes CPU caches only so far (this one is on {cache.device}); "
            "use kv.transport: grpc",
            "UNIMPLEMENTED",
        )


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one block's row of ``t`` ([layers, blocks, ...])."""
    return t.stride(1) * t.element_size()


class StagingPool:
    """Registered host memory the send side stages blocks in: fixed slots, each owned by one
    transfer until the receiver's READ notification (or the transfer's end) frees it. An
    aborted transfer's slots drain first: unused for ABORT_DRAIN_S or until their READ's
    notification, so a READ under way never reads a slot refilled for another transfer."""

    def __init__(self, agent: NixlAgent, slot_bytes: int, slots: int = SLOTS) -> None:
        self.agent = agent
        self.slot_bytes = slot_bytes
        self.buffer = torch.empty(slot_bytes * slots, dtype=torch.uint8)
        agent.register(self.buffer)
        self._owner: list[str | None] = [None] * slots
        self._drained_at = [0.0] * slots  # time.monotonic() a drained slot is usable again
        self._cond = threading.Condition()

    def address(self, slot: int) -> int:
        return self.buffer.data_ptr() + slot * self.slot_bytes

    def view(self, slot: int, start: int, nbytes: int) -> torch.Tensor:
        begin = slot * self.slot_bytes + start
        return self.buffer[begin : begin + nbytes]

    def acquire(self, owner: str, deadline: float) -> int:
        with self._cond:
            while True:
                self._collect()
                now = time.monotonic()
                for slot, held in enumerate(self._owner):
                    if held is None and now >= self._drained_at[slot]:
                        self._owner[slot] = owner
                        self.agent.hold()
                        return slot
                if now > deadline:
                    raise KVTransferError("KV staging memory stayed full", "DEADLINE_EXCEEDED")
                self._cond.wait(0.001)

    def release_all(self, owner: str, drain: bool = False) -> None:
        """Free ``owner``'s slots: at once when its transfer finished (every READ done), after
        draining when it was aborted (``drain``)."""
        with self._cond:
            mine = [slot for slot, held in enumerate(self._owner) if held == owner]
            for slot in mine:
                self._owner[slot] = None
                if drain:
                    self._drained_at[slot] = time.monotonic() + ABORT_DRAIN_S
            self.agent.unhold(len(mine))
            if drain and mine:
                self.agent.linger(ABORT_DRAIN_S)
            self._cond.notify_all()

    def _collect(self) -> None:
        """Free the slots receivers have read (their notifications: b"<owner>:<slot>")."""
        for note in self.agent.notifications():
            owner, _, slot = note.decode(errors="replace").rpartition(":")
            if not slot.isdigit() or int(slot) >= len(self._owner):
                continue
            if self._owner[int(slot)] == owner:
                self._owner[int(slot)] = None
                self.agent.unhold()
            elif self._owner[int(slot)] is None:  # a drained slot's READ ended
                self._drained_at[int(slot)] = 0.0


class NixlSendStream(KVSendStream):
    transport = NAME

    def __init__(self, cache: PagedKVCache, pool: StagingPool, stream: TransferStream) -> None:
        self._cache = cache
        self._pool = pool
        self._stream = stream
        self._owner = stream.handshake.lease_id
        self._rows = [_row_bytes(t) for t in cache.tensors()]
        self._blocks_per_slot = max(1, pool.slot_bytes // sum(self._rows))

    def send_layer(self, layer: int, block_ids: torch.Tensor, first_block: int = 0) -> None:
        count = len(block_ids)
        self._stream.check_blocks(first_block, count)
        deadline = self._stream.deadline
        for start in range(0, count, self._blocks_per_slot):
            ids = block_ids[start : start + self._blocks_per_slot]
            slot = self._pool.acquire(self._owner, deadline)
            staged, offset = [], 0
            for tensor, row in zip(self._cache.tensors(), self._rows, strict=True):
                source = tensor[layer]
                out = self._pool.view(slot, offset, len(ids) * row)
                torch.index_select(
                    source, 0, ids, out=out.view(source.dtype).view(-1, *source.shape[1:])
                )
                staged.append(out.numpy())
                offset += len(ids) * row
            ready = functools.partial(
                frames.encode_ready,
                layer,
                first_block + start,
                len(ids),
                slot,
                self._pool.address(slot),
                staged,
            )
            self._stream.send_encoded(ready, offset)  # its CRC32C is taken on the drain thread

    def finish(self, first_token: int, fork_tokens=()) -> TransferResult:
        try:
            return self._stream.finish(first_token, fork_tokens)
        finally:
            self._pool.release_all(self._owner)

    def abort(self, reason: str) -> None:
        self._stream.abort(reason)
        self._pool.release_all(self._owner, drain=True)


class NixlSendSide(GrpcSendSide):
    transport = NAME

    def __init__(self, cache: PagedKVCache, fingerprint: dict, options: KVTransferOptions) -> None:
        _cpu_only(cache)
        super().__init__(cache, fingerprint, options)
        self.agent = NixlAgent("prefill")
        block = sum(_row_bytes(t) for t in cache.tensors())
        self.pool = StagingPool(self.agent, max(SLOT_BYTES, block))
        self._metadata = self.agent.metadata()

    def open(self, handle: KVHandle, request_id: str, num_tokens: int) -> NixlSendStream:
        if handle.receivers:
            raise KVTransferError(
                "a tensor-parallel decode replica takes KV over kv.transport 'grpc' only",
                "FAILED_PRECONDITION",
            )
        wire = "fp8" if self._cache.is_fp8 else "passthrough"  # pages as they are
        stream = self._open_stream(handle, request_id, num_tokens, wire, nixl_agent=self._metadata)
        return NixlSendStream(self._cache, self.pool, stream)

    def close(self) -> None:
        super().close()
        self.agent.close()


class NixlStreamReader:
    """The receive side of one NIXL stream: READs each kv_ready frame's slot into the lease's
    blocks and checks its CRC32C. Called by the receiver's handler thread, inside
    ``LeaseTable.write`` (the lease's blocks are its own while it runs)."""

    def __init__(self, agent: NixlAgent, peer: str, cache: PagedKVCache) -> None:
        self.agent = agent
        self.peer = peer
        self.cache = cache
        self._parts = cache.tensors()
        self._rows = [_row_bytes(t) for t in self._parts]

    def read(
        self,
        lease_id: str,
        frame: frames.ReadyFrame,
        block_ids: list[int],
        cancelled: Callable[[], bool],
    ) -> None:
        """READ the frame's slot into ``block_ids``; ``cancelled()`` (the stream is gone) stops
        a READ under way."""
        count = len(block_ids)
        if frame.nbytes != count * sum(self._rows):
            raise FrameError(
                f"kv_ready frame of {frame.nbytes} bytes for {count} blocks "
                f"(expected {count * sum(self._rows)})"
            )
        runs = block_runs(block_ids)
        local, remote, views, address = [], [], [], frame.address
        for tensor, row in zip(self._parts, self._rows, strict=True):
            rows = tensor[frame.layer].reshape(tensor.shape[1], -1).view(torch.uint8).numpy()
            base = tensor.data_ptr() + frame.layer * tensor.stride(0) * tensor.element_size()
            for first, _, n in runs:
                local.append((base + first * row, n * row))
                remote.append((address, n * row))
                views.append(rows[first : first + n])
                address += n * row
        deadline = time.monotonic() + READ_TIMEOUT_S
        note = f"{lease_id}:{frame.slot}".encode()
        self.agent.read(self.peer, local, remote, note, deadline, cancelled)
        crc = 0
        for view in views:
            crc = crc32c.crc32c(view, crc)
        if crc != frame.data_crc:
            raise FrameError(
                f"KV data of layer {frame.layer} corrupted in transit (checksum mismatch)"
            )


class NixlReceiver:
    """What a KV receiver server needs for NIXL streams: its agent, the cache registered."""

    def __init__(self, cache: PagedKVCache) -> None:
        _cpu_only(cache)
        self.agent = NixlAgent("decode")
        for tensor in cache.tensors():
            self.agent.register(tensor)

    def stream(self, handshake: frames.Handshake, cache: PagedKVCache) -> NixlStreamReader:
        if handshake.payload_dtype != dtype_name(cache.dtype):
            raise HandshakeError(
                f"NIXL moves pages as they are: the sender's cache is {handshake.payload_dtype}, "
                f"this one {dtype_name(cache.dtype)} (give both pools the same kv cache dtype)"
            )
        return NixlStreamReader(self.agent, self.agent.add_peer(handshake.nixl_agent), cache)


class NixlRecvSide(GrpcRecvSide):
    transport = NAME
    _nixl: NixlReceiver | None = None

    def _server_options(self, cache: PagedKVCache) -> dict:
        self._nixl = NixlReceiver(cache)
        return {"nixl": self._nixl, "data_channel": False}

    def stop(self) -> None:
        super().stop()
        if self._nixl is not None:
            self._nixl.agent.close()


register_transport(Transport(NAME, NixlSendSide, NixlRecvSide))


class AutoSendSide(KVSendSide):
    """``kv.transport: auto`` on a prefill worker: each handle's own transport (NIXL where the
    decode side offers it, gRPC otherwise), a side of each made on first use."""

    transport = "auto"

    def __init__(self, cache: PagedKVCache, fingerprint: dict, options: KVTransferOptions) -> None:
        self._make = lambda name: transport(name).send_side(  # noqa: E731
            cache, fingerprint, dataclasses.replace(options, transport=name)
        )
        self._sides: dict[str, KVSendSide] = {}
        self._lock = threading.Lock()

    def open(self, handle: KVHandle, request_id: str, num_tokens: int) -> KVSendStream:
        if handle.transport not in ("grpc", "nixl"):
            raise KVTransferError(
                f"a {handle.transport!r} KV handle reached the 'auto' transport (grpc or nixl)",
                "FAILED_PRECONDITION",
            )
        with self._lock:
            side = self._sides.get(handle.transport)
            if side is None:
                side = self._sides[handle.transport] = self._make(handle.transport)
        return side.open(handle, request_id, num_tokens)

    def close(self) -> None:
        with self._lock:
            sides, self._sides = list(self._sides.values()), {}
        for side in sides:
            side.close()


def auto_recv_side(fingerprint: dict, options: KVTransferOptions) -> KVRecvSide:
    """``kv.transport: auto`` on a decode worker: NIXL where it is installed (such a receiver
    takes gRPC kv frames too), gRPC otherwise."""
    side = GrpcRecvSide if nixl_unavailable() is not None else NixlRecvSide
    return side(fingerprint, options)


register_transport(Transport("auto", AutoSendSide, auto_recv_side))
