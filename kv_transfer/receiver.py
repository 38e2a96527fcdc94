"""The decode side of the KV transfer: a gRPC server that writes incoming KV blocks straight
into the blocks a lease reserved in the decode worker's paged cache.

One ``Push`` stream = one request's cache (see :mod:`kv_transfer.frames`). The handler checks
the token, parses the handshake, attaches the stream to its lease, then for each frame checks
the metadata against what the handshake promised (layer range, block range in order, payload
size), decodes the payload (bounded: one frame) and copies it into ``cache.k[layer]`` /
``cache.v[layer]`` at the lease's block ids through the lease table, which guarantees the
blocks are still the lease's and holds no engine lock meanwhile (kv_transfer.lease).
Any refusal or a broken stream releases the lease before the status goes back; a silent peer
is caught by the lease deadline (sweeper thread) and by the RPC's deadline.

Fast path: the Push method is registered with a hand-written deserializer
(:func:`wire.parse_wire`), so a frame's payload is a ``memoryview`` of the received message
and goes into the cache through ``torch.frombuffer`` without a copy of its own. A handshake
asking for a data channel gets one when ``data_channel=True`` here: the server
sends the port of its data listener and a one-use ticket as gRPC initial metadata; the
sender's TCP (TLS when the server is) connection must present the same token and the ticket.
Its kv frames are checked as frames from the gRPC stream are; where the cache keeps a
payload's bytes as they are, the payload is received straight into the lease's blocks and
checked there (``_place_in_cache``), else into a reused buffer and then copied. The end frame
and the status stay on gRPC.

Thread-safety: gRPC runs handlers on a thread pool; handlers share only the lease table (its
lock) and the counters (their own lock). Callers: the decode worker constructs, ``start``s and
``stop``s it.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
import time
from concurrent import futures

import grpc
import torch

from engine.kv_cache import LayerKV, PagedKVCache
from kv_transfer import frames, wire
from kv_transfer.codec import WireSpec, decode_chunk, decode_layers, dtype_from_name
from kv_transfer.connector import ReceiverStats
from kv_transfer.data_channel import (
    MAX_MESSAGE_BYTES,
    POLL_S,
    DataListener,
    Place,
    receive_frames,
    tls_context,
)
from kv_transfer.errors import FrameError, HandshakeError, KVTransferError
from kv_transfer.lease import Lease, LeaseTable
from protos import kv_transfer_pb2

logger = logging.getLogger(__name__)

DATA_CONNECT_TIMEOUT_S = 10.0  # a sender that asked for a data channel must connect by then


def grpc_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel/server options of both ends: message limits above the frame size, and HTTP/2
    frames of up to 16 MiB (the 16 KiB default splits every KV frame into hundreds)."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
    ]


def _push_handler(server: KVReceiverServer) -> grpc.GenericRpcHandler:
    """KVTransfer.Push of protos/kv_transfer.proto, frames parsed by hand (no protobuf
    objects, payloads as memoryviews of the received messages)."""
    push = grpc.stream_unary_rpc_method_handler(
        server._push,
        request_deserializer=wire.parse_wire,
        response_serializer=kv_transfer_pb2.PushReply.SerializeToString,
    )
    return grpc.method_handlers_generic_handler("pdcluster.kv_transfer.KVTransfer", {"Push": push})


class KVReceiverServer:
    """gRPC KV receiver of one decode worker.

    ``fingerprint`` is the decode model's ``ModelConfig.fingerprint()``; a sender must present
    the same. ``token`` is required from every peer (``authorization: Bearer <token>``);
    ``tls_cert``/``tls_key`` (PEM) switch the port to TLS. ``data_channel`` offers senders
    that ask a raw TCP (TLS) data connection for the kv frames on ``data_port`` (0: any free
    port) of the same host; the gRPC port stays the control plane. ``kv_heads``: the
    model's KV heads [start, stop) this cache holds (one rank's of a tensor-parallel
    replica); by default all of them. Each stream fills the heads its handshake names.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        leases: LeaseTable,
        fingerprint: dict,
        *,
        host: str = "127.0.0.1",
        advertised_host: str | None = None,
        port: int = 0,
        token: str,
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
        sweep_interval_s: float = 0.5,
        max_workers: int = 8,
        data_channel: bool = False,
        data_port: int = 0,
        nixl=None,
        kv_heads: tuple[int, int] | None = None,
    ) -> None:
        if not token:
            raise ValueError("the KV receiver needs a non-empty shared token")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key")
        self.cache = cache
        self.leases = leases
        self.fingerprint = frames.normalise_fingerprint(fingerprint)
        self.host = host
        self.advertised_host = advertised_host or host  # what senders dial (not a wildcard)
        self.port = port
        self._expected_auth = f"Bearer {token}".encode()
        self._tls = (tls_cert, tls_key) if tls_cert is not None else None
        self.sweep_interval_s = sweep_interval_s
        self.max_workers = max_workers
        self._stats = ReceiverStats()
        self._stats_lock = threading.Lock()
        self._server: grpc.Server | None = None
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self.data_channel = data_channel
        self.data_port = data_port
        self._data: DataListener | None = None
        self.nixl = nixl  # NIXL transport: takes kv_ready frames (kv_transfer.nixl_transport)
        self.kv_heads = kv_heads or (0, cache.num_kv_heads)
        if self.kv_heads[1] - self.kv_heads[0] != cache.num_kv_heads:
            raise ValueError(f"kv_heads {kv_heads} do not match the cache's {cache.num_kv_heads}")

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> int:
        """Bind, serve, start the lease sweeper. Returns the bound port."""
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=self.max_workers, thread_name_prefix="kv-receiver"
            ),
            options=grpc_options(),
        )
        server.add_generic_rpc_handlers((_push_handler(self),))
        bind = f"{self.host}:{self.port}"
        if self._tls is None:
            port = server.add_insecure_port(bind)
        else:
            creds = grpc.ssl_server_credentials([(self._tls[1], self._tls[0])])
            port = server.add_secure_port(bind, creds)
        if port == 0:
            raise OSError(f"KV receiver could not bind {bind}")
        if self.data_channel:
            tls = tls_context(self._tls[0], self._tls[1]) if self._tls is not None else None
            self._data = DataListener(self.host, self.data_port, self._expected_auth, tls)
            self.data_port = self._data.port
        server.start()
        self._server, self.port = server, port
        self._stop.clear()
        self._sweeper = threading.Thread(target=self._sweep, name="kv-lease-sweeper", daemon=True)
        self._sweeper.start()
        return port

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (in-flight transfers are cancelled, their leases released)."""
        self._stop.set()
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None
        if self._data is not None:
            self._data.close()
            self._data = None
        if self._sweeper is not None:
            self._sweeper.join()
            self._sweeper = None

    @property
    def stats(self) -> ReceiverStats:
        return self._stats

    @property
    def address(self) -> str:
        return f"{self.advertised_host}:{self.port}"

    def _sweep(self) -> None:
        while not self._stop.wait(self.sweep_interval_s):
            try:
                expired = self.leases.expire()
            except Exception:  # a sweeper must outlive one bad sweep
                logger.exception("lease sweep failed")
                continue
            for lease_id in expired:
                logger.warning("KV lease %s expired; its blocks went back to the pool", lease_id)

    # ---- the handler ------------------------------------------------------------------
    def _authorized(self, context) -> bool:
        for key, value in context.invocation_metadata():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected_auth)
        return False

    def _push(self, request_iterator, context) -> kv_transfer_pb2.PushReply:
        if not self._authorized(context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong KV transfer token")
        start = time.perf_counter()
        transfer = _Transfer(self, context)
        code: grpc.StatusCode | None = None
        reply = None
        try:
            reply = transfer.run(request_iterator)
        except KVTransferError as err:
            code, message = grpc.StatusCode[err.code], err.message
        except grpc.RpcError:
            # The request iterator raises this when the peer cancels or the call dies.
            code, message = grpc.StatusCode.CANCELLED, "KV stream broken or cancelled by the sender"
        except Exception as err:  # never leak blocks on a bug: release, then report
            logger.exception("KV receiver failed")
            code, message = grpc.StatusCode.INTERNAL, f"KV receiver error: {err!r}"
        finally:
            transfer.release_unless_complete()
            transfer.close_data()
            with self._stats_lock:
                was = self._stats
                self._stats = ReceiverStats(
                    bytes_received=was.bytes_received + transfer.payload_bytes,
                    transfers_completed=was.transfers_completed + (code is None),
                    transfers_failed=was.transfers_failed + (code is not None),
                    seconds=was.seconds + time.perf_counter() - start,
                    data_channel_transfers=was.data_channel_transfers + transfer.used_data_channel,
                )
        if code is not None:
            context.abort(code, message)
        return reply


class _Transfer:
    """State of one stream on the receiver; used by one handler thread."""

    def __init__(self, server: KVReceiverServer, context) -> None:
        self.server = server
        self.context = context
        self.cache = server.cache
        self.lease: Lease | None = None
        self.completed = False
        self.payload_bytes = 0
        self.failure = "stream ended"
        self.data: socket.socket | None = None
        self.used_data_channel = False
        self._ticket: str | None = None
        self.nixl = None  # NIXL: this stream's reader (kv_transfer.nixl_transport)
        self.heads: tuple[int, int] = (0, 0)  # the model's KV heads this stream fills

    def release_unless_complete(self) -> None:
        if self.lease is not None and not self.completed:
            self.server.leases.release(self.lease.lease_id, self.failure)

    def close_data(self) -> None:
        listener = self.server._data
        if self._ticket is not None and listener is not None:
            listener.forget(self._ticket)
        data, self.data = self.data, None
        if data is not None:
            try:  # wakes a reader blocked in a receive
                data.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            data.close()

    def run(self, request_iterator) -> kv_transfer_pb2.PushReply:
        it = iter(request_iterator)
        first = next(it, None)
        if first is None:
            raise FrameError("empty KV stream: expected a handshake frame")
        handshake = _decode(first)
        if not isinstance(handshake, frames.Handshake):
            raise FrameError("the first frame of a KV stream must be the handshake")
        frames.check_version(handshake)
        leases = self.server.leases
        self.heads = heads = self._stream_heads(handshake)
        self.lease = lease = leases.begin(
            handshake.lease_id, handshake.request_id, heads, self.server.kv_heads
        )
        try:
            self._check_handshake(handshake, lease)
            spec = WireSpec(
                self.cache.block_size,
                heads[1] - heads[0],
                self.cache.head_dim,
                dtype_from_name(handshake.payload_dtype),
            )
            if handshake.nixl_agent:
                if self.server.nixl is None:
                    raise HandshakeError(
                        "this receiver takes no NIXL transfers (its kv.transport is not nixl)"
                    )
                if heads != (0, int(handshake.fingerprint["num_kv_heads"])):
                    raise HandshakeError("NIXL transfers carry all KV heads (tp 1 replicas only)")
                self.nixl = self.server.nixl.stream(handshake, self.cache)
            if handshake.data_channel:
                if self.server._data is not None:
                    self._open_data_channel(lease, it)
                else:  # the sender waits for an answer: kv frames over gRPC, then
                    self.context.send_initial_metadata((("kv-data-port", "none"),))
            self._receive_layers(it, spec, lease)
        except KVTransferError as err:
            self.failure = f"refused: {err.message}"
            raise
        except BaseException:
            self.failure = "stream broken"
            raise
        return kv_transfer_pb2.PushReply(
            request_id=lease.request_id,
            lease_id=lease.lease_id,
            layers_received=self.cache.num_layers,
            payload_bytes=self.payload_bytes,
        )

    def _stream_heads(self, handshake: frames.Handshake) -> tuple[int, int]:
        """The stream's KV heads, which must be some of this cache's (checked before the
        lease is touched)."""
        ours = self.server.kv_heads
        heads = handshake.heads or (0, int(self.server.fingerprint["num_kv_heads"]))
        if not ours[0] <= heads[0] < heads[1] <= ours[1]:
            raise HandshakeError(
                f"the stream carries KV heads {list(heads)}, but this receiver holds heads "
                f"{list(ours)}: the sender's tensor-parallel layout does not match this one"
            )
        return heads

    def _check_handshake(self, handshake: frames.Handshake, lease: Lease) -> None:
        frames.check_compatible(
            handshake,
            fingerprint=self.server.fingerprint,
            block_size=self.cache.block_size,
            cache_is_fp8=self.cache.is_fp8,
        )
        if handshake.first_block != lease.first_block:
            raise FrameError(
                f"handshake starts at block {handshake.first_block} but lease {lease.lease_id} "
                f"holds blocks 0..{lease.first_block - 1} already and needs the rest"
            )
        if handshake.num_blocks != len(lease.block_ids):
            raise FrameError(
                f"handshake announces {handshake.num_tokens} tokens ({handshake.num_blocks} "
                f"blocks) but lease {lease.lease_id} holds {len(lease.block_ids)} blocks"
            )

    def _open_data_channel(self, lease: Lease, it) -> None:
        """Offer the data channel (port + ticket as initial metadata) and take the sender's
        answer, its next gRPC frame: connected, wait for its authenticated connection; not
        (the port is out of its reach), the kv frames come over gRPC."""
        listener = self.server._data
        self._ticket, slot = listener.expect()
        self.context.send_initial_metadata(
            (("kv-data-port", str(listener.port)), ("kv-data-ticket", self._ticket))
        )
        message = next(it, None)
        if message is None:
            raise FrameError("KV stream truncated: it ended before answering the data offer")
        answer = _decode(message)
        if not isinstance(answer, frames.DataAnswer):
            raise FrameError(
                f"expected the answer to the data channel offer, got a {type(answer).__name__}"
            )
        if not answer.connected:
            listener.forget(self._ticket)
            return
        deadline = time.monotonic() + DATA_CONNECT_TIMEOUT_S
        while not slot.ready.wait(POLL_S):
            self._check_alive()
            if time.monotonic() > deadline:
                raise KVTransferError(
                    f"the sender never opened its KV data connection (lease {lease.lease_id})",
                    "DEADLINE_EXCEEDED",
                )
        self.data = slot.conn
        self.used_data_channel = True

    def _cancelled(self) -> bool:
        return not self.context.is_active() or self.server._stop.is_set()

    def _check_alive(self) -> None:
        if self._cancelled():
            raise KVTransferError("KV stream broken or cancelled by the sender", "CANCELLED")

    def _place_in_cache(
        self, spec: WireSpec, lease: Lease, block_ids, heads: slice
    ) -> Place | None:
        """Where the data channel's reader puts a kv frame's payload as it arrives: straight
        into the lease's blocks (one copy, the socket's, instead of two), wherever the cache
        keeps the payload's bytes as they are: on the CPU, in the payload's dtype, with all
        the stream's heads. The bytes land before their checksum is known, as a NIXL READ's
        do: only in blocks of this lease, through the lease table (nothing lands after the
        lease ended, and the blocks stay out of the pool until the receive has ended), and
        the lease completes only after every frame's checksum passed. None where the cache
        takes the payload otherwise (decoded, cast, some heads): each frame is then received
        into a buffer and copied."""
        cache = self.cache
        if (
            cache.device.type != "cpu"
            or spec.dtype != cache.dtype
            or heads != slice(0, cache.num_kv_heads)
        ):
            return None
        leases = self.server.leases

        def place(meta: bytes, length: int, fill) -> list | None:
            kv = frames.peek_kv(meta)
            if kv is None:
                return None
            layer, start, count, layer_count = kv
            if (
                layer + layer_count > cache.num_layers
                or start + count > len(block_ids)
                or length != spec.chunk_bytes(count) * layer_count
            ):
                return None  # received whole; the checks say what is wrong with it
            ids = block_ids[start : start + count]
            layers = range(layer, layer + layer_count)
            views = [view for i in layers for view in cache.payload_views(i, ids)]
            leases.write(lease, fill, views)
            return views

        return place

    def _receive_layers(self, it, spec: WireSpec, lease: Lease) -> None:
        cache, leases = self.cache, self.server.leases
        num_layers, num_blocks = cache.num_layers, len(lease.block_ids)
        # per layer: the next block index expected (those before first_block are cached here)
        next_block = [lease.first_block] * num_layers
        if cache.device.type == "cpu":
            block_ids = lease.block_ids
        else:
            block_ids = torch.tensor(lease.block_ids, dtype=torch.int64, device=cache.device)
        # CUDA: copies on a side stream of their own, so they never queue behind (or hold up)
        # the engine's kernels; the end records an event the admission waits on.
        copies = torch.cuda.Stream(cache.device) if cache.device.type == "cuda" else None
        lo = self.server.kv_heads[0]
        heads = slice(self.heads[0] - lo, self.heads[1] - lo)  # of this cache's heads
        num_kv_frames = 0
        if self.data is not None:
            place = self._place_in_cache(spec, lease, block_ids, heads)
            messages = _chain(
                receive_frames(self.data, self._check_alive, self.close_data, place), it, self
            )
        else:
            messages = it
        for message in messages:
            frame = _decode(message)
            if isinstance(frame, frames.EndFrame):
                if self.nixl is not None:
                    self.nixl.verify()  # every READ's checksum, before the lease completes
                missing = [i for i, b in enumerate(next_block) if b != num_blocks]
                if missing:
                    raise FrameError(f"KV stream ended with layers {missing} missing or partial")
                if frame.num_kv_frames != num_kv_frames:
                    raise FrameError(
                        f"end frame counts {frame.num_kv_frames} kv frames, {num_kv_frames} arrived"
                    )
                if copies is not None:
                    lease.ready_event = torch.cuda.Event()
                    lease.ready_event.record(copies)
                    if not leases.needs_first_token:  # a peer rank: its engine never waits
                        lease.ready_event.synchronize()
                leases.complete(lease, frame.first_token, frame.fork_tokens, self.heads)
                self.completed = True
                return
            if isinstance(frame, frames.Handshake):
                raise FrameError("a second handshake in one KV stream")
            if isinstance(frame, frames.DataAnswer):
                raise FrameError("a data channel answer where no offer was made")
            start, count = frame.block_start, frame.block_count
            for layer in frame.layers:
                _check_blocks(layer, start, count, next_block, num_blocks)
            if isinstance(frame, frames.ReadyFrame):  # NIXL: the blocks wait at the sender
                if self.nixl is None:
                    raise FrameError("a kv_ready frame in a stream that did not ask for NIXL")
                ids = lease.block_ids[start : start + count]
                leases.write(lease, self.nixl.read, lease.lease_id, frame, ids, self._cancelled)
                self.payload_bytes += frame.nbytes
            else:
                landed = isinstance(frame.payload, wire.Landed)  # already in the lease's blocks
                payload = frame.payload if landed else memoryview(frame.payload)
                size = spec.chunk_bytes(count)  # of one layer
                if payload.nbytes != size * frame.layer_count:
                    raise FrameError(
                        f"payload of {frame.layer_count} layers of {count} blocks must be "
                        f"{size * frame.layer_count} bytes, got {payload.nbytes}"
                    )
                if not landed:
                    ids = block_ids[start : start + count]
                    on_side_stream = (
                        torch.cuda.stream(copies)
                        if copies is not None
                        else contextlib.nullcontext()
                    )
                    with on_side_stream:
                        if frame.layer_count == 1:
                            blocks = LayerKV(
                                *decode_chunk(payload, count, spec, cache.dtype, cache.device)
                            )
                            leases.write(lease, cache.scatter, frame.layer, ids, blocks, heads)
                        else:  # all the frame's layers decoded at once, written in one go
                            stacked = decode_layers(
                                payload, frame.layer_count, count, spec, cache.dtype, cache.device
                            )
                            leases.write(
                                lease,
                                cache.scatter_layers,
                                frame.layers,
                                ids,
                                LayerKV(*stacked),
                                heads,
                            )
                self.payload_bytes += payload.nbytes
            for layer in frame.layers:
                next_block[layer] += count
            num_kv_frames += 1
        raise FrameError("KV stream truncated: it ended before the final frame")


def _check_blocks(
    layer: int, start: int, count: int, next_block: list[int], num_blocks: int
) -> None:
    """A frame's blocks are in range and the next ones its layer expects (``next_block``:
    per layer, the next block index expected)."""
    if layer >= len(next_block):
        raise FrameError(f"layer {layer} out of range (model has {len(next_block)})")
    if start + count > num_blocks:
        raise FrameError(
            f"blocks [{start}, {start + count}) of layer {layer} out of range "
            f"(the sequence has {num_blocks})"
        )
    expected = next_block[layer]
    if start != expected:
        what = "duplicate layer" if expected == num_blocks else "blocks out of order"
        raise FrameError(
            f"{what}: layer {layer} frame starts at block {start}, expected {expected}"
        )


def _chain(data_messages, grpc_messages, transfer: _Transfer):
    """The data channel's kv frames, then the gRPC stream's (the end frame)."""
    yield from data_messages
    transfer.close_data()
    yield from grpc_messages


def _decode(message) -> frames.Frame:
    error = getattr(message, "error", None)
    if error:
        raise FrameError(error)
    return frames.decode_frame(message.meta, message.payload, message.crc32)
