"""The NIXL transport (registered as "nixl"; needs the nixl extra): the blocks move by NIXL
(UCX) READs straight from the prefill cache into the decode cache, one copy and no staging;
gRPC keeps the token-checked handshake, the compatibility check, integrity and the first token.

A transfer: each side registered its whole cache with its agent once. The handshake carries
the prefill side's agent metadata and where its cache lies (``nixl_layout``); for each layer's
new blocks the prefill side sends a ``kv_ready`` frame (kv_transfer.frames) naming its cache
blocks and the CRC32C of their bytes (taken on the sender's drain thread). The decode side
READs those blocks straight into the lease's blocks, checks the CRC32C, and its READ leaves a
notification ``"<lease_id>:<seq>"``. Pull, not push: every byte that lands in the decode cache
lands by the decode side's own READ, inside ``LeaseTable.write``, so nothing is written after
a lease is released or expired (a late one-sided WRITE into reused blocks cannot happen by
construction), and a sender sees no decode memory at all.

The prefill blocks are read in place after ``send_layer`` returned (``reads_in_place``): the
prefill worker keeps them unchanged until the stream's ``on_sources_free`` callback, which
comes when ``finish`` returns (the receiver answers after its last READ), or after an abort
once every frame's READ notified or ABORT_DRAIN_S passed (a receiver cancels its READ when it
sees the stream gone).

Trust: NIXL does not authenticate peers. The receiver adds a sender's agent only after the
gRPC handshake passed the token check; a sender exposes its registered cache to the decode
peers it opened streams to (reads only). As with the anchors, run it on a private cluster
network; TLS and the token still cover gRPC.
The caches on both sides must have the same dtype (pages move as they are: fp8 pages with
their scales, or the model dtype); ``kv.wire_dtype`` applies to the gRPC transport only. CPU
caches only for now: on CUDA, READs into device memory and a device-side checksum are to come.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import crc32c
import numpy as np
import torch

from engine.kv_cache import PagedKVCache, byte_rows
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
READ_TIMEOUT_S = 30.0
# After an abort, its source blocks stay held and the agent progressing this long, unless
# every READ of them notified first: a receiver's READ may be under way, and it ends (done, or
# cancelled once the receiver sees the abort).
ABORT_DRAIN_S = 2.0
_DRAIN_POLL_S = 0.001


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


def _layer_address(t: torch.Tensor, layer: int) -> int:
    return t.data_ptr() + layer * t.stride(0) * t.element_size()


def paired_runs(source: np.ndarray, dest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start index, length) of each stretch over which both block lists run on by one: one
    READ descriptor pair each."""
    breaks = np.flatnonzero((np.diff(source) != 1) | (np.diff(dest) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    return starts, np.diff(np.concatenate((starts, [len(source)])))


class ReadTracker:
    """Which kv_ready frames receivers have READ, per lease (their notifications
    ``b"<lease_id>:<seq>"``); shared by a send side's streams, any thread."""

    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent
        self._read: dict[str, set[int]] = {}
        self._lock = threading.Lock()

    def open(self, lease_id: str) -> None:
        with self._lock:
            self._read.setdefault(lease_id, set())

    def close(self, lease_id: str) -> None:
        with self._lock:
            self._read.pop(lease_id, None)

    def count_read(self, lease_id: str) -> int:
        """Frames of the lease's stream READ so far (collecting new notifications)."""
        notes = self.agent.notifications()
        with self._lock:
            for note in notes:
                owner, _, seq = note.decode(errors="replace").rpartition(":")
                if seq.isdigit() and owner in self._read:
                    self._read[owner].add(int(seq))
            return len(self._read.get(lease_id, ()))


class NixlSendStream(KVSendStream):
    transport = NAME
    reads_in_place = True

    def __init__(self, cache: PagedKVCache, tracker: ReadTracker, stream: TransferStream) -> None:
        self._cache = cache
        self._tracker = tracker
        self._stream = stream
        self._lease_id = stream.handshake.lease_id
        self._holding = False  # the agent progresses for our receivers' READs
        self._frames = 0  # kv_ready frames a receiver may READ (known once the stream ended)
        self._lock = threading.Lock()
        self._ended = False  # finish or abort came
        self._free = False  # nothing reads the sources any more
        self._callbacks: list[Callable[[], None]] = []
        tracker.open(self._lease_id)

    def send_layer(self, layer: int, block_ids: torch.Tensor, first_block: int = 0) -> None:
        ids = block_ids.tolist()
        data = self._cache.payload_views(layer, ids)  # the blocks' bytes: no copy
        if not self._holding:
            self._holding = True
            self._tracker.agent.hold()  # progress while receivers READ our cache
        self._stream.send_ready(layer, first_block, ids, data)  # CRC32C on the drain thread

    def finish(self, first_token: int, fork_tokens=()) -> TransferResult:
        try:
            result = self._stream.finish(first_token, fork_tokens)
        except BaseException:
            self._end(drain=True)
            raise
        self._end(drain=False)  # the receiver answered after its last READ
        return result

    def abort(self, reason: str) -> None:
        self._stream.abort(reason)
        self._end(drain=True)

    def on_sources_free(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._free:
                self._callbacks.append(callback)
                return
        callback()

    def _end(self, drain: bool) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._frames = self._stream.seal_ready_frames()
        if not drain or self._all_read():
            self._sources_free()
            return
        self._tracker.agent.linger(ABORT_DRAIN_S)
        threading.Thread(target=self._drain, name="nixl-drain", daemon=True).start()

    def _all_read(self) -> bool:
        return self._frames == 0 or self._tracker.count_read(self._lease_id) >= self._frames

    def _drain(self) -> None:
        give_up = time.monotonic() + ABORT_DRAIN_S
        while not self._all_read() and time.monotonic() < give_up:
            time.sleep(_DRAIN_POLL_S)
        self._sources_free()

    def _sources_free(self) -> None:
        if self._holding:
            self._tracker.agent.unhold()
        self._tracker.close(self._lease_id)
        with self._lock:
            self._free = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


class NixlSendSide(GrpcSendSide):
    transport = NAME

    def __init__(self, cache: PagedKVCache, fingerprint: dict, options: KVTransferOptions) -> None:
        _cpu_only(cache)
        super().__init__(cache, fingerprint, options)
        self.agent = NixlAgent("prefill")
        for tensor in cache.tensors():  # receivers READ the blocks where they are
            self.agent.register(tensor)
        self.tracker = ReadTracker(self.agent)
        self._metadata = self.agent.metadata()
        self._layout = tuple(
            (t.data_ptr(), t.stride(0) * t.element_size(), _row_bytes(t)) for t in cache.tensors()
        )

    def open(self, handle: KVHandle, request_id: str, num_tokens: int) -> NixlSendStream:
        if handle.receivers:
            raise KVTransferError(
                "a tensor-parallel decode replica takes KV over kv.transport 'grpc' only",
                "FAILED_PRECONDITION",
            )
        wire = "fp8" if self._cache.is_fp8 else "passthrough"  # pages as they are
        stream = self._open_stream(
            handle,
            request_id,
            num_tokens,
            wire,
            nixl_agent=self._metadata,
            nixl_layout=self._layout,
            nixl_blocks=self._cache.num_blocks,
        )
        return NixlSendStream(self._cache, self.tracker, stream)

    def close(self) -> None:
        super().close()
        self.agent.close()


class NixlStreamReader:
    """The receive side of one NIXL stream: READs each kv_ready frame's blocks from the
    sender's cache into the lease's blocks (``read``, inside ``LeaseTable.write``: the lease's
    blocks are its own while it runs), and checks their CRC32C on the receiver's checksum
    thread while the next frame's READ runs; ``verify`` waits for every check, and the
    receiver calls it before the lease completes. Called by the receiver's handler thread."""

    def __init__(
        self,
        agent: NixlAgent,
        peer: str,
        cache: PagedKVCache,
        handshake: frames.Handshake,
        checker: ThreadPoolExecutor,
    ) -> None:
        self.agent = agent
        self.peer = peer
        self._checker = checker
        self._checks: list[tuple[range, int, Future]] = []  # (layers, expected CRC, its CRC)
        self._parts = cache.tensors()
        self._rows = [_row_bytes(t) for t in self._parts]
        theirs = [row for _, _, row in handshake.nixl_layout]
        if theirs != self._rows:
            raise HandshakeError(
                f"the sender's cache rows are {theirs} bytes per block, this cache's {self._rows}"
            )
        self._layout = handshake.nixl_layout
        self._source_blocks = handshake.nixl_blocks

    def read(
        self,
        lease_id: str,
        frame: frames.ReadyFrame,
        block_ids: list[int],
        cancelled: Callable[[], bool],
    ) -> None:
        """READ the frame's source blocks into ``block_ids``; ``cancelled()`` (the stream is
        gone) stops a READ under way."""
        count = len(block_ids)
        expected = frame.layer_count * count * sum(self._rows)
        if frame.nbytes != expected:
            raise FrameError(
                f"kv_ready frame of {frame.nbytes} bytes for {frame.layer_count} layers of "
                f"{count} blocks (expected {expected})"
            )
        source = np.asarray(frame.source_blocks, dtype=np.int64)
        if int(source.max()) >= self._source_blocks:
            raise FrameError(
                f"kv_ready frame names source block {int(source.max())} of a cache of "
                f"{self._source_blocks}"
            )
        dest = np.asarray(block_ids, dtype=np.int64)
        starts, lengths = paired_runs(source, dest)
        local, remote, views = [], [], []  # views: the landed bytes in payload order
        for layer in frame.layers:
            for tensor, row, (address, layer_stride, _) in zip(
                self._parts, self._rows, self._layout, strict=True
            ):
                sizes = lengths * row
                local.append(
                    np.stack((_layer_address(tensor, layer) + dest[starts] * row, sizes), 1)
                )
                remote.append(
                    np.stack((address + layer * layer_stride + source[starts] * row, sizes), 1)
                )
                rows = byte_rows(tensor[layer])
                views += [
                    rows[d : d + n]
                    for d, n in zip(dest[starts].tolist(), lengths.tolist(), strict=True)
                ]
        deadline = time.monotonic() + READ_TIMEOUT_S
        note = f"{lease_id}:{frame.seq}".encode()
        self.agent.read(
            self.peer, np.concatenate(local), np.concatenate(remote), note, deadline, cancelled
        )
        self._checks.append((frame.layers, frame.data_crc, self._checker.submit(_crc, views)))
        while self._checks and self._checks[0][2].done():  # a bad frame fails early
            self._check(*self._checks.pop(0))

    def verify(self) -> None:
        """Wait for every READ's checksum; FrameError on the first that does not match."""
        while self._checks:
            self._check(*self._checks.pop(0))

    @staticmethod
    def _check(layers: range, expected: int, crc: Future) -> None:
        if crc.result() != expected:
            which = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
            raise FrameError(f"KV data of {which} corrupted in transit (checksum mismatch)")


def _crc(views: list[np.ndarray]) -> int:
    crc = 0
    for view in views:
        crc = crc32c.crc32c(view, crc)  # the GIL released on large buffers
    return crc


class NixlReceiver:
    """What a KV receiver server needs for NIXL streams: its agent, the cache registered."""

    def __init__(self, cache: PagedKVCache) -> None:
        _cpu_only(cache)
        self.agent = NixlAgent("decode")
        for tensor in cache.tensors():
            self.agent.register(tensor)
        # One thread checks every stream's READs: each check overlaps the next READ.
        self.checker = ThreadPoolExecutor(1, thread_name_prefix="nixl-crc")

    def close(self) -> None:
        self.checker.shutdown(wait=False, cancel_futures=True)
        self.agent.close()

    def stream(self, handshake: frames.Handshake, cache: PagedKVCache) -> NixlStreamReader:
        if handshake.payload_dtype != dtype_name(cache.dtype):
            raise HandshakeError(
                f"NIXL moves pages as they are: the sender's cache is {handshake.payload_dtype}, "
                f"this one {dtype_name(cache.dtype)} (give both pools the same kv cache dtype)"
            )
        peer = self.agent.add_peer(handshake.nixl_agent)
        return NixlStreamReader(self.agent, peer, cache, handshake, self.checker)


class NixlRecvSide(GrpcRecvSide):
    transport = NAME
    _nixl: NixlReceiver | None = None

    def _server_options(self, cache: PagedKVCache) -> dict:
        self._nixl = NixlReceiver(cache)
        return {"nixl": self._nixl, "data_channel": False}

    def stop(self) -> None:
        super().stop()
        if self._nixl is not None:
            self._nixl.close()


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
