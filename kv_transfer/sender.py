"""The prefill side of the KV transfer: streams one request's KV cache to a decode worker,
layer by layer, while later layers still compute.

``KVSender`` holds one gRPC channel to one decode worker's receiver and opens a
``TransferStream`` per request. The stream's frames go through a bounded queue that gRPC's
own thread drains: ``send_layer`` (called from the model's ``layer_done`` hook) encodes a
layer and enqueues its frames (views of the layer's CPU tensors, no payload copy), and blocks
once ``max_frames_in_flight`` frames wait (backpressure: memory held by a slow transfer is
bounded by that many frames).

Data path: the kv frames go over the gRPC stream, serialised by hand (no protobuf objects),
unless the sender was made with ``data_channel=True`` and the transfer carries at least
``data_channel_min_bytes``: then the handshake asks for a data channel; when the receiver
offers one (gRPC initial metadata, see :mod:`kv_transfer.frames`), the drain thread connects
to it (TLS when the channel is TLS), authenticates with the same token plus the stream's
ticket, and writes the kv frames there with ``sendmsg`` straight from the tensors' memory;
the handshake, the end frame and the receiver's status stay on gRPC. It about doubles
loopback throughput. A port it cannot reach (a firewall) sends the frames over gRPC, and the
sender does not ask again for ``DATA_RETRY_AFTER_S``.

Thread-safety: a ``KVSender`` may be shared by threads (gRPC channels are thread-safe); one
``TransferStream`` is driven by one thread.
"""

from __future__ import annotations

import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import grpc
import torch

from kv_transfer import data_channel, frames, wire
from kv_transfer.codec import (
    EncodedLayer,
    WireSpec,
    dtype_name,
    encode_layer,
    encode_layers,
    layer_chunk_parts,
    payload_dtype_for,
    stacked_layer_parts,
)
from kv_transfer.connector import TransferResult
from kv_transfer.errors import KVTransferError
from kv_transfer.receiver import grpc_options
from protos import kv_transfer_pb2

logger = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024
# The most bytes one kv_ready frame names: each frame costs ~3.6 ms on this path whatever its
# size (measured, 2 cores), so layers ready together go as one larger READ.
MAX_READY_FRAME_BYTES = 64 * 1024 * 1024
PUSH_METHOD = "/pdcluster.kv_transfer.KVTransfer/Push"
_DONE = object()  # ends the request iterator
# Queued items: kv frames may take the data channel, control frames not; kv_ready frames (NIXL)
# are numbered and checksummed on the drain thread, the end frame counts what went before it.
# A _KV item is a _Piece (merged with the pieces queued behind it) or a tuple of pieces that
# send_layers made one frame.
_KV, _CONTROL, _READY, _END = 0, 1, 2, 3
# How long a sender tries to reach a data channel before sending over gRPC instead, and how
# long it then sends over gRPC without asking again.
DATA_CONNECT_TIMEOUT_S = 2.0
DATA_RETRY_AFTER_S = 60.0
_STATUS_WAIT_S = 2.0  # after a data-channel error: how long to wait for the receiver's status


@dataclass(frozen=True)
class _Piece:
    """Blocks of one layer waiting in the queue: a kv frame's payload parts (``_KV`` items), or
    views of the cache blocks a kv_ready frame names (``_READY`` items). Pieces of one kind,
    of consecutive layers with the same blocks, that wait together go out as one frame."""

    layer: int
    first_block: int
    block_count: int
    buffers: list  # in payload order
    nbytes: int
    source_blocks: tuple[int, ...] = ()  # _READY: the cache's blocks

    def extends(self, last: _Piece) -> bool:
        """May follow ``last`` in its frame."""
        return (
            self.layer == last.layer + 1
            and self.first_block == last.first_block
            and self.block_count == last.block_count
            and self.source_blocks == last.source_blocks
        )


class KVSender:
    """Client of one decode worker's KV receiver; reuses one channel for every transfer."""

    def __init__(
        self,
        address: str,
        token: str,
        *,
        tls_root_cert: bytes | None = None,
        max_frames_in_flight: int = 8,
        timeout_s: float = 30.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        tls_server_name: str | None = None,
        data_channel: bool = False,
        data_channel_min_bytes: int = 0,
    ) -> None:
        if max_frames_in_flight < 1:
            raise ValueError("max_frames_in_flight must be at least 1")
        self.address = address
        self.max_frames_in_flight = max_frames_in_flight
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.data_channel = data_channel
        self.data_channel_min_bytes = data_channel_min_bytes
        self._data_retry_at = 0.0  # ask for the data channel from then on
        self._token = token
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
        options = grpc_options()
        self._ssl: ssl.SSLContext | None = None
        self._server_name = tls_server_name or self._host
        if tls_root_cert is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            creds = grpc.ssl_channel_credentials(root_certificates=tls_root_cert)
            self._channel = grpc.secure_channel(address, creds, options=options)
            self._ssl = ssl.create_default_context(cadata=tls_root_cert.decode())
        # Push with a hand-written serializer: frames go out as (meta, payload parts, crc)
        # encoded straight to Frame bytes, never through protobuf objects.
        push = self._channel.stream_unary(
            PUSH_METHOD,
            request_serializer=wire.serialize_wire,
            response_deserializer=kv_transfer_pb2.PushReply.FromString,
        )
        self._stub = type("KVTransferStub", (), {"Push": push})()

    def wants_data_channel(self) -> bool:
        """Whether a new stream asks for the data channel: when configured, unless its port
        was out of reach within the last DATA_RETRY_AFTER_S."""
        return self.data_channel and time.monotonic() >= self._data_retry_at

    def data_channel_unreachable(self, port, err: BaseException) -> None:
        """A stream could not connect to the data channel: the next streams use gRPC alone
        for a while. Any stream's thread may call it."""
        if time.monotonic() >= self._data_retry_at:
            logger.warning(
                "KV data channel %s:%s unreachable (%s): kv frames go over gRPC for %.0f s",
                self._host, port, err, DATA_RETRY_AFTER_S,
            )  # fmt: skip
        self._data_retry_at = time.monotonic() + DATA_RETRY_AFTER_S

    def connect_data(self, port: int, ticket: str, timeout_s: float):
        """The authenticated data connection of one stream (TLS when the channel is)."""
        return data_channel.connect(
            self._host, port, self._token, ticket, timeout_s, self._ssl, self._server_name
        )

    def open(
        self,
        request_id: str,
        lease_id: str,
        fingerprint: dict,
        block_size: int,
        num_tokens: int,
        num_layers: int,
        wire_dtype: str,
        cache_dtype: torch.dtype,
        nixl_agent: bytes = b"",
        heads: tuple[int, int] | None = None,
        nixl_layout: tuple[tuple[int, int, int], ...] = (),
        nixl_blocks: int = 0,
        first_block: int = 0,
    ) -> TransferStream:
        """Start the RPC and send the handshake. ``wire_dtype``: "passthrough" or "fp8";
        ``cache_dtype``: the dtype of the blocks ``send_layer`` will get. ``nixl_agent``: the
        NIXL transport's agent metadata, and where its registered cache lies (its blocks
        then go as ``send_ready`` frames).
        ``heads``: the model's KV heads the blocks hold (default: all). ``first_block``: the
        first block sent (those before it the receiver has)."""
        payload_dtype = payload_dtype_for(wire_dtype, cache_dtype)
        handshake = frames.Handshake(
            request_id=request_id,
            lease_id=lease_id,
            fingerprint=frames.normalise_fingerprint(fingerprint),
            block_size=block_size,
            num_tokens=num_tokens,
            wire_dtype=wire_dtype,
            payload_dtype=dtype_name(payload_dtype),
            nixl_agent=nixl_agent,
            nixl_layout=nixl_layout,
            nixl_blocks=nixl_blocks,
            heads=heads,
            first_block=first_block,
        )
        start, stop = handshake.head_range()
        spec = WireSpec(
            block_size,
            stop - start,
            int(fingerprint["head_dim"]),
            payload_dtype,
        )
        if (
            not nixl_agent
            and self.wants_data_channel()
            and num_layers * spec.chunk_bytes(handshake.num_blocks) >= self.data_channel_min_bytes
        ):
            handshake = replace(handshake, data_channel=True)
        return TransferStream(self, handshake, spec, num_layers, cache_dtype)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TransferStream:
    """One request's transfer: ``send_layer`` for each layer, then ``finish`` (or ``abort``)."""

    def __init__(
        self,
        sender: KVSender,
        handshake: frames.Handshake,
        spec: WireSpec,
        num_layers: int,
        cache_dtype: torch.dtype,
    ) -> None:
        self.handshake = handshake
        self.spec = spec
        self.num_layers = num_layers
        self.cache_dtype = cache_dtype
        self._sender = sender
        self._timeout_s = sender.timeout_s
        self._data: socket.socket | None = None
        self.used_data_channel = False  # the kv frames went over the data channel
        self._data_error: BaseException | None = None
        self._blocks_per_frame = spec.blocks_per_frame(sender.max_frame_bytes)
        self._queue: queue.Queue = queue.Queue(maxsize=sender.max_frames_in_flight)
        self._held_back = None  # an item the drain thread took but could not merge
        self._start = time.perf_counter()
        self._deadline = time.monotonic() + sender.timeout_s
        self.payload_bytes = 0
        self.num_frames = 0  # sent (the drain thread counts)
        self._num_kv_frames = 0  # kv and kv_ready frames sent
        self._ready_lock = threading.Lock()
        self._ready_frames = 0  # kv_ready frames numbered
        self._ready_sealed = False
        self._closed = False
        self._future = sender._stub.Push.future(
            self._frames(), metadata=sender._metadata, timeout=sender.timeout_s
        )
        self._put((_CONTROL, frames.encode_handshake(handshake)))

    # ---- public -----------------------------------------------------------------------
    def send_layer(
        self,
        layer: int,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        *,
        first_block: int = 0,
        copy: bool = True,
    ) -> None:
        """Ship blocks ``[first_block, first_block + n)`` of one layer: ``[n, bs, Hkv, D]`` in
        block-table order (any device); by default the whole sequence. A long prompt's
        chunks ship as they are computed: each layer's blocks must arrive in order, each
        once. Scales ``[n, Hkv]`` are given when the source cache is fp8. Blocks while
        ``max_frames_in_flight`` frames are queued; raises KVTransferError if the receiver has
        already refused the stream. The caller may reuse the tensors once this returns, unless
        ``copy=False``: then the frames are sent straight from CPU tensors' memory, which the
        caller must leave unmodified until ``finish``/``abort`` returns (tensors on another
        device are copied to the host either way)."""
        if self._closed:
            raise KVTransferError("the transfer stream is closed", "FAILED_PRECONDITION")
        count, block_size = k_blocks.shape[:2]
        layer_payload = self._encoded(
            encode_layer, k_blocks, v_blocks, k_scale, v_scale, first_block, count, block_size, copy
        )
        for start, n, parts in layer_chunk_parts(layer_payload, self._blocks_per_frame):
            # The checksum is taken by the drain thread, off the engine's thread.
            nbytes = sum(p.nbytes for p in parts)
            self._put((_KV, _Piece(layer, first_block + start, n, parts, nbytes)))
            self.payload_bytes += nbytes

    def send_layers(
        self,
        first_layer: int,
        k_layers: torch.Tensor,
        v_layers: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        *,
        first_block: int = 0,
        copy: bool = True,
    ) -> None:
        """``send_layer`` for layers ``[first_layer, first_layer + L)`` in turn, the same
        blocks of each: ``[L, n, bs, Hkv, D]`` (scales ``[L, n, Hkv]``). Where one frame takes
        all n blocks of a layer, the layers are encoded in one pass and queued as frames of
        whole layers, up to ``max_frame_bytes`` each: a short prompt's layers, which a step
        ends with together, go out in a few frames and wait for one queue slot per frame, not
        per layer. Otherwise layer by layer. Same contract as ``send_layer``."""
        if self._closed:
            raise KVTransferError("the transfer stream is closed", "FAILED_PRECONDITION")
        if k_layers.dim() != 5 or k_layers.shape != v_layers.shape:
            raise ValueError(
                f"k and v layers must both be [layers, n, block_size, kv_heads, head_dim], got "
                f"{tuple(k_layers.shape)} and {tuple(v_layers.shape)}"
            )
        layers, count = k_layers.shape[:2]
        if layers < 1:
            raise ValueError("send_layers needs at least one layer")
        if count > self._blocks_per_frame:
            for i in range(layers):
                scales = (None, None) if k_scale is None else (k_scale[i], v_scale[i])
                self.send_layer(
                    first_layer + i, k_layers[i], v_layers[i], *scales,
                    first_block=first_block, copy=copy,
                )  # fmt: skip
            return
        encoded = self._encoded(
            encode_layers, k_layers, v_layers, k_scale, v_scale, first_block, count,
            k_layers.shape[2], copy,
        )  # fmt: skip
        runs: list[list[_Piece]] = [[]]
        for i, parts in enumerate(stacked_layer_parts(encoded)):
            piece = _Piece(first_layer + i, first_block, count, parts, sum(p.nbytes for p in parts))
            run_bytes = sum(p.nbytes for p in runs[-1])
            if runs[-1] and run_bytes + piece.nbytes > self._sender.max_frame_bytes:
                runs.append([])
            runs[-1].append(piece)
        for run in runs:
            self._put((_KV, tuple(run)))
            self.payload_bytes += sum(p.nbytes for p in run)

    def _encoded(
        self, encode, k, v, k_scale, v_scale, first_block, count, block_size, copy
    ) -> EncodedLayer:
        """``encode`` (``encode_layer`` or ``encode_layers``) of ``count`` blocks from
        ``first_block``, checked to be the sequence's, the last block's rows past its last
        token left out of the fp8 scale; with ``copy``, owned by the stream."""
        self.check_blocks(first_block, count)
        encoded = encode(
            k,
            v,
            wire_dtype=self.handshake.wire_dtype,
            num_tokens=min(
                self.handshake.num_tokens - first_block * block_size, count * block_size
            ),
            k_scale=k_scale,
            v_scale=v_scale,
        )
        # Queued frames are views of these tensors: own them, so the caller may reuse its own.
        return _owned(encoded, (k, v, k_scale, v_scale)) if copy else encoded

    def check_blocks(self, first_block: int, count: int) -> None:
        """ValueError unless blocks ``[first_block, first_block + count)`` are the sequence's."""
        total = self.handshake.num_blocks
        if first_block < 0 or count < 1 or first_block + count > total:
            raise ValueError(
                f"blocks [{first_block}, {first_block + count}) are not within the "
                f"{total} blocks of {self.handshake.num_tokens} tokens"
            )

    @property
    def deadline(self) -> float:
        """When this transfer times out (time.monotonic)."""
        return self._deadline

    def send_ready(
        self, layer: int, first_block: int, source_blocks: Sequence[int], data: list
    ) -> None:
        """Queue a kv_ready frame (NIXL): blocks ``[first_block, first_block +
        len(source_blocks))`` of ``layer`` lie in the sender's cache blocks ``source_blocks``;
        ``data`` are views of their bytes in payload order, which the drain thread checksums.
        It numbers each frame (``seal_ready_frames``)."""
        self.check_blocks(first_block, len(source_blocks))
        nbytes = sum(memoryview(d).nbytes for d in data)
        piece = _Piece(layer, first_block, len(source_blocks), data, nbytes, tuple(source_blocks))
        self._put((_READY, piece))
        self.payload_bytes += nbytes

    def seal_ready_frames(self) -> int:
        """After the stream ended (``finish`` returned or raised, or ``abort``): how many
        kv_ready frames were numbered, each of which a receiver may READ; none is numbered, or
        sent, after this."""
        with self._ready_lock:
            self._ready_sealed = True
            return self._ready_frames

    def finish(self, first_token: int | None, fork_tokens: Sequence[int] = ()) -> TransferResult:
        """Send the final frame (the first token, and the forks' first tokens; None on a
        sharded transfer's streams that do not carry them) and wait for the receiver's
        answer. Raises KVTransferError with the receiver's status code and
        message if it refused the transfer."""
        self._put((_END, (first_token, tuple(fork_tokens))))
        self._end_iterator()
        try:
            self._future.result(timeout=max(0.0, self._deadline - time.monotonic()) + 1.0)
        except grpc.FutureTimeoutError:
            self.abort("timed out waiting for the receiver")
            raise KVTransferError("KV transfer timed out", "DEADLINE_EXCEEDED") from None
        except grpc.RpcError as err:
            raise _from_rpc_error(err) from None
        element = self.cache_dtype.itemsize
        kv_bytes = (
            2
            * self.num_layers
            * self.handshake.num_tokens
            * self.spec.num_kv_heads
            * self.spec.head_dim
            * element
        )
        return TransferResult(
            request_id=self.handshake.request_id,
            lease_id=self.handshake.lease_id,
            payload_bytes=self.payload_bytes,
            kv_bytes=kv_bytes,
            num_frames=self.num_frames,
            seconds=time.perf_counter() - self._start,
        )

    def abort(self, reason: str) -> None:
        """Cancel the RPC; the receiver releases the lease at once. Idempotent."""
        self._future.cancel()
        self._end_iterator()
        data = self._data
        if data is not None:
            try:  # unblock a drain thread stuck in a send; it closes the socket
                data.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ---- internals --------------------------------------------------------------------
    def _next_item(self):
        if self._held_back is not None:
            item, self._held_back = self._held_back, None
            return item
        while True:
            try:
                return self._queue.get(timeout=0.1)
            except queue.Empty:
                future = getattr(self, "_future", None)
                if future is not None and future.done():
                    return _DONE

    def _merged(self, kind: int, first: _Piece) -> list[_Piece]:
        """``first`` and the queued pieces of its kind that extend it, up to a frame's bytes:
        the layers that wait together (a backlog) go as one frame. Takes only what is queued
        already."""
        run, nbytes = [first], first.nbytes
        limit = self._sender.max_frame_bytes if kind == _KV else MAX_READY_FRAME_BYTES
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return run
            piece = item[1] if item is not _DONE and item[0] == kind else None
            if (
                not isinstance(piece, _Piece)  # not a piece, or a run of its own
                or not piece.extends(run[-1])
                or nbytes + piece.nbytes > limit
            ):
                self._held_back = item
                return run
            run.append(piece)
            nbytes += piece.nbytes

    def _encode(self, kind: int, item):
        """A queued item's frame (kind, (meta, payload, crc)); None when nothing more may be
        sent (kv_ready frames were sealed)."""
        if kind == _KV or kind == _READY:
            # a tuple: a run send_layers built, already one frame's worth
            run = list(item) if isinstance(item, tuple) else self._merged(kind, item)
            first = run[0]
            buffers = [b for piece in run for b in piece.buffers]
            if kind == _KV:
                frame = frames.encode_kv_parts(
                    first.layer, first.first_block, first.block_count, buffers, len(run)
                )
            else:
                with self._ready_lock:
                    if self._ready_sealed:
                        return None
                    seq = self._ready_frames
                    self._ready_frames += 1
                frame = frames.encode_ready(
                    first.layer, first.first_block, seq, first.source_blocks, buffers, len(run)
                )
                kind = _CONTROL
            self._num_kv_frames += 1
            return kind, frame
        if kind == _END:
            return _CONTROL, frames.encode_end(item[0], self._num_kv_frames, item[1])
        return kind, item

    def _frames(self):
        # Runs on gRPC's thread: hands the queued frames to the RPC, the kv frames to the
        # data channel when there is one, until _DONE.
        try:
            item = self._next_item()
            if item is _DONE:
                return
            self.num_frames += 1
            yield item[1]  # the handshake
            if self.handshake.data_channel:
                answer = self._open_data_channel()
                if answer is _DONE:
                    return
                if answer is not None:
                    self.num_frames += 1
                    yield answer
            while True:
                item = self._next_item()
                if item is _DONE:
                    return
                encoded = self._encode(*item)
                if encoded is None:
                    return
                kind, frame = encoded
                self.num_frames += 1
                if self._data is not None:
                    try:
                        if kind == _KV:
                            data_channel.send_frame(self._data, frame)
                            continue
                        self._data.sendall(b"\0\0\0\0")  # a zero length: kv frames done
                    except OSError as err:
                        self._data_failed(err)
                        return
                    self._close_data()
                yield frame
        finally:
            self._close_data()

    def _open_data_channel(self):
        """After the handshake: connect to the data channel the receiver offers, if any.
        Returns the answer frame to send (connected or not: a port out of reach sends the kv
        frames over gRPC), None when the receiver declined (no answer), _DONE when the call
        died."""
        try:
            metadata = dict(self._future.initial_metadata() or ())
        except Exception:  # the call died before the receiver answered
            return _DONE
        port, ticket = metadata.get("kv-data-port"), metadata.get("kv-data-ticket")
        if port is None or ticket is None:
            # Declined ("none"): the kv frames go over gRPC. No answer at all: the call died.
            return _DONE if self._future.done() else None
        remaining = self._deadline - time.monotonic()
        try:
            self._data = self._sender.connect_data(
                int(port), ticket, max(0.1, min(DATA_CONNECT_TIMEOUT_S, remaining))
            )
        except (OSError, ValueError) as err:
            self._sender.data_channel_unreachable(port, err)
            return frames.encode_data_answer(False)
        self.used_data_channel = True
        return frames.encode_data_answer(True)

    def _data_failed(self, err: BaseException) -> None:
        """The data channel broke: take the receiver's status if it comes (it may have
        refused the stream and closed the connection), else cancel the call."""
        self._data_error = err
        try:
            self._future.exception(timeout=_STATUS_WAIT_S)
        except Exception:
            pass
        if not self._future.done():
            self._future.cancel()

    def _close_data(self) -> None:
        data, self._data = self._data, None
        if data is not None:
            data.close()

    def _put(self, frame) -> None:
        if self._closed:
            raise KVTransferError("the transfer stream is closed", "FAILED_PRECONDITION")
        while True:
            if self._future.done():
                self._closed = True
                raise self._failure()
            if time.monotonic() > self._deadline:
                self.abort("deadline")
                raise KVTransferError("KV transfer timed out (backpressure)", "DEADLINE_EXCEEDED")
            try:
                self._queue.put(frame, timeout=0.05)
            except queue.Full:
                continue
            return

    def _end_iterator(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Drop frames nobody will send, so _DONE fits and gRPC's consumer thread ends.
        while True:
            try:
                self._queue.put_nowait(_DONE)
                return
            except queue.Full:
                if not self._future.done():
                    try:
                        self._queue.put(_DONE, timeout=0.05)
                        return
                    except queue.Full:
                        continue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    pass

    def _failure(self) -> KVTransferError:
        try:
            self._future.result(timeout=0)
        except grpc.RpcError as err:
            return _from_rpc_error(err)
        except grpc.FutureCancelledError:
            if self._data_error is not None:
                return KVTransferError(
                    f"KV data channel to {self._sender.address} failed: {self._data_error}",
                    "UNAVAILABLE",
                )
            return KVTransferError("KV transfer was aborted", "CANCELLED")
        except Exception as err:
            return KVTransferError(f"KV transfer failed: {err!r}")
        return KVTransferError("the receiver answered before the transfer finished", "INTERNAL")


def _owned(layer, sources):
    """``layer`` with every tensor that shares memory with one of the caller's (CPU) tensors
    copied, so queued frames never see the caller reuse its tensors. The copy is a numpy
    memcpy: one thread, GIL released (torch's would fan out to its intra-op pool)."""
    ptrs = {
        t.untyped_storage().data_ptr() for t in sources if t is not None and t.device.type == "cpu"
    }
    if not ptrs:
        return layer

    def own(t):
        if t is None or t.untyped_storage().data_ptr() not in ptrs:
            return t
        raw = t.reshape(-1).view(torch.uint8).numpy().copy()
        return torch.from_numpy(raw).view(t.dtype).view(t.shape)

    return type(layer)(own(layer.k), own(layer.v), own(layer.k_scale), own(layer.v_scale))


def _from_rpc_error(err: grpc.RpcError) -> KVTransferError:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    return KVTransferError(details or "KV transfer failed", code.name if code else "UNKNOWN")
