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
(:func:`frames.parse_wire`), so a frame's payload is a ``memoryview`` of the received message
and goes into the cache through ``torch.frombuffer`` without a copy of its own. A handshake
asking for a data channel gets one when ``data_channel=True`` here (opt-in): the server
sends the port of its data listener and a one-use ticket as gRPC initial metadata; the
sender's TCP (TLS when the server is) connection must present the same token and the ticket;
its kv frames are received into a reused buffer, then checked and stored exactly as frames
from the gRPC stream are. The end frame and the status stay on gRPC.

Thread-safety: gRPC runs handlers on a thread pool; handlers share only the lease table (its
lock) and the counters (their own lock). Callers: the decode worker constructs, ``start``s and
``stop``s it.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import queue
import secrets
import socket
import ssl
import struct
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch

from engine.kv_cache import PagedKVCache
from kv_transfer import frames
from kv_transfer.codec import WireSpec, decode_chunk, dtype_from_name
from kv_transfer.errors import FrameError, KVTransferError
from kv_transfer.lease import Lease, LeaseTable
from protos import kv_transfer_pb2

logger = logging.getLogger(__name__)

# Frames are bounded by the sender (4 MiB by default); allow headroom for metadata and for
# senders configured with larger frames.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DATA_CONNECT_TIMEOUT_S = 10.0  # a sender that asked for a data channel must connect by then
_PREAMBLE_TIMEOUT_S = 5.0
_POLL_S = 0.25  # how often a blocked receive looks at the call's state
_DATA_BUFFERS = 3  # receive buffers per data channel (frames read ahead of the one stored)


def grpc_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel/server options of both ends: message limits above the frame size, and HTTP/2
    frames of up to 16 MiB (the 16 KiB default splits every KV frame into hundreds)."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
    ]


@dataclass
class ReceiverStats:
    bytes_received: int = 0  # payload bytes of accepted frames
    transfers_completed: int = 0
    transfers_failed: int = 0
    seconds: float = 0.0  # wall time spent in transfers (completed or failed)
    data_channel_transfers: int = 0  # transfers whose kv frames came over the data channel


def _push_handler(server: KVReceiverServer) -> grpc.GenericRpcHandler:
    """KVTransfer.Push of protos/kv_transfer.proto, frames parsed by hand (no protobuf
    objects, payloads as memoryviews of the received messages)."""
    push = grpc.stream_unary_rpc_method_handler(
        server._push,
        request_deserializer=frames.parse_wire,
        response_serializer=kv_transfer_pb2.PushReply.SerializeToString,
    )
    return grpc.method_handlers_generic_handler("pdcluster.kv_transfer.KVTransfer", {"Push": push})


@dataclass
class _Slot:
    """A data connection a stream waits for, by ticket."""

    ready: threading.Event = field(default_factory=threading.Event)
    conn: socket.socket | None = None


class _DataListener:
    """Accepts data connections: checks the preamble (token, ticket) and hands each good one
    to the stream that issued the ticket. A peer without the token is refused and closed; it
    never reaches a stream or a lease."""

    def __init__(
        self, host: str, port: int, expected_auth: bytes, tls: ssl.SSLContext | None
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host.strip("[]"), port), family=family)
        self.port = self.sock.getsockname()[1]
        self._expected_auth = expected_auth
        self._tls = tls
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kv-data-accept", daemon=True)
        self._thread.start()

    def expect(self) -> tuple[str, _Slot]:
        ticket = secrets.token_urlsafe(18)
        slot = _Slot()
        with self._lock:
            self._slots[ticket] = slot
        return ticket, slot

    def forget(self, ticket: str) -> None:
        with self._lock:
            slot = self._slots.pop(ticket, None)
        if slot is not None and slot.conn is not None and not slot.ready.is_set():
            slot.conn.close()

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(2.0)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            threading.Thread(
                target=self._admit, args=(conn,), name="kv-data-admit", daemon=True
            ).start()

    def _admit(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(_PREAMBLE_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
            magic = _recv_exact(conn, len(frames.DATA_MAGIC))
            if magic != frames.DATA_MAGIC:
                raise PermissionError("not a KV data connection")
            auth = _recv_exact(conn, struct.unpack("<H", _recv_exact(conn, 2))[0])
            ticket = _recv_exact(conn, struct.unpack("<H", _recv_exact(conn, 2))[0])
            if not hmac.compare_digest(auth, self._expected_auth):
                raise PermissionError("missing or wrong KV transfer token")
            with self._lock:
                slot = self._slots.pop(ticket.decode(errors="replace"), None)
            if slot is None:
                raise PermissionError("unknown or used KV data ticket")
        except (OSError, ValueError, struct.error) as err:
            logger.warning("KV data connection refused: %s", err)
            try:
                conn.sendall(f"refused: {err}\n".encode())
            except OSError:
                pass
            conn.close()
            return
        conn.settimeout(_POLL_S)
        slot.conn = conn
        slot.ready.set()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        got = conn.recv_into(view)
        if got == 0:
            raise ConnectionError("connection closed during the preamble")
        view = view[got:]
    return bytes(buf)


def _tls_context(cert: bytes, key: bytes) -> ssl.SSLContext:
    """A server context from PEM bytes (ssl loads chains only from files: a private temp dir)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        for path, data in ((cert_path, cert), (key_path, key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        context.load_cert_chain(cert_path, key_path)
    return context


class KVReceiverServer:
    """gRPC KV receiver of one decode worker.

    ``fingerprint`` is the decode model's ``ModelConfig.fingerprint()``; a sender must present
    the same. ``token`` is required from every peer (``authorization: Bearer <token>``);
    ``tls_cert``/``tls_key`` (PEM) switch the port to TLS. ``data_channel`` offers senders
    that ask a raw TCP (TLS) data connection for the kv frames on ``data_port`` (0: any free
    port) of the same host; the gRPC port stays the control plane.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        leases: LeaseTable,
        fingerprint: dict,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str,
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
        sweep_interval_s: float = 0.5,
        max_workers: int = 8,
        data_channel: bool = False,
        data_port: int = 0,
    ) -> None:
        if not token:
            raise ValueError("the KV receiver needs a non-empty shared token")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key")
        self.cache = cache
        self.leases = leases
        self.fingerprint = frames.normalise_fingerprint(fingerprint)
        self.host = host
        self.port = port
        self._expected_auth = f"Bearer {token}".encode()
        self._tls = (tls_cert, tls_key) if tls_cert is not None else None
        self.sweep_interval_s = sweep_interval_s
        self.max_workers = max_workers
        self.stats = ReceiverStats()
        self._stats_lock = threading.Lock()
        self._server: grpc.Server | None = None
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self.data_channel = data_channel
        self.data_port = data_port
        self._data: _DataListener | None = None

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
            tls = _tls_context(self._tls[0], self._tls[1]) if self._tls is not None else None
            self._data = _DataListener(self.host, self.data_port, self._expected_auth, tls)
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
    def address(self) -> str:
        return f"{self.host}:{self.port}"

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
                self.stats.seconds += time.perf_counter() - start
                self.stats.bytes_received += transfer.payload_bytes
                self.stats.data_channel_transfers += transfer.used_data_channel
                if code is None:
                    self.stats.transfers_completed += 1
                else:
                    self.stats.transfers_failed += 1
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
        self.lease = lease = leases.begin(handshake.lease_id, handshake.request_id)
        try:
            self._check_handshake(handshake, lease)
            spec = WireSpec(
                self.cache.block_size,
                self.cache.num_kv_heads,
                self.cache.head_dim,
                dtype_from_name(handshake.payload_dtype),
            )
            if handshake.data_channel:
                if self.server._data is not None:
                    self._open_data_channel(lease)
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

    def _check_handshake(self, handshake: frames.Handshake, lease: Lease) -> None:
        frames.check_compatible(
            handshake,
            fingerprint=self.server.fingerprint,
            block_size=self.cache.block_size,
            cache_is_fp8=self.cache.is_fp8,
        )
        if handshake.num_blocks != len(lease.block_ids):
            raise FrameError(
                f"handshake announces {handshake.num_tokens} tokens ({handshake.num_blocks} "
                f"blocks) but lease {lease.lease_id} holds {len(lease.block_ids)} blocks"
            )

    def _open_data_channel(self, lease: Lease) -> None:
        """Offer the data channel (port + ticket as initial metadata), wait for the sender's
        authenticated connection."""
        listener = self.server._data
        self._ticket, slot = listener.expect()
        self.context.send_initial_metadata(
            (("kv-data-port", str(listener.port)), ("kv-data-ticket", self._ticket))
        )
        deadline = time.monotonic() + DATA_CONNECT_TIMEOUT_S
        while not slot.ready.wait(_POLL_S):
            self._check_alive()
            if time.monotonic() > deadline:
                raise KVTransferError(
                    f"the sender never opened its KV data connection (lease {lease.lease_id})",
                    "DEADLINE_EXCEEDED",
                )
        self.data = slot.conn
        self.used_data_channel = True

    def _check_alive(self) -> None:
        if not self.context.is_active() or self.server._stop.is_set():
            raise KVTransferError("KV stream broken or cancelled by the sender", "CANCELLED")

    def _recv_into(self, view: memoryview) -> None:
        conn = self.data
        while view:
            try:
                got = conn.recv_into(view)
            except TimeoutError:
                self._check_alive()
                continue
            except OSError as err:
                raise FrameError(f"KV data connection broken: {err}") from None
            if got == 0:
                raise FrameError("KV data channel truncated: the connection closed mid-stream")
            view = view[got:]

    def _data_messages(self):
        """Frames of the data channel until the zero length that ends them. A reader thread
        receives them into a few reused buffers while this thread checks and stores the
        previous one; each yielded frame is valid until the next is asked for."""
        free: queue.Queue = queue.Queue()
        for _ in range(_DATA_BUFFERS):
            free.put(memoryview(bytearray(0)))
        ready: queue.Queue = queue.Queue()
        stop = threading.Event()

        def read() -> None:
            header = memoryview(bytearray(4))
            try:
                while not stop.is_set():
                    try:
                        buf = free.get(timeout=_POLL_S)
                    except queue.Empty:
                        continue
                    self._recv_into(header)
                    size = int.from_bytes(header, "little")
                    if size == 0:
                        ready.put(None)
                        return
                    if size > MAX_MESSAGE_BYTES:
                        raise FrameError(f"data frame of {size} bytes (limit {MAX_MESSAGE_BYTES})")
                    if size > buf.nbytes:
                        buf = memoryview(bytearray(size))
                    self._recv_into(buf[:size])
                    ready.put((buf, size))
            except BaseException as err:  # handed to the handler thread, which raises it
                ready.put(err)

        reader = threading.Thread(target=read, name="kv-data-reader", daemon=True)
        reader.start()
        try:
            while True:
                try:
                    item = ready.get(timeout=_POLL_S)
                except queue.Empty:
                    self._check_alive()
                    continue
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                buf, size = item
                yield frames.parse_wire(buf[:size])
                free.put(buf)
        finally:
            stop.set()
            if reader.is_alive():
                self.close_data()  # unblocks a receive
                reader.join()

    def _receive_layers(self, it, spec: WireSpec, lease: Lease) -> None:
        cache, leases = self.cache, self.server.leases
        num_layers, num_blocks = cache.num_layers, len(lease.block_ids)
        next_block = [0] * num_layers  # per layer: the next block index expected
        block_ids = torch.tensor(lease.block_ids, dtype=torch.int64, device=cache.device)
        on_cpu = cache.device.type == "cpu"
        # CUDA: copies on a side stream of their own, so they never queue behind (or hold up)
        # the engine's kernels; the end records an event the admission waits on.
        copies = torch.cuda.Stream(cache.device) if cache.device.type == "cuda" else None
        num_kv_frames = 0
        if self.data is not None:
            messages = _chain(self._data_messages(), it, self)
        else:
            messages = it
        for message in messages:
            frame = _decode(message)
            if isinstance(frame, frames.EndFrame):
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
                leases.complete(lease, frame.first_token, frame.fork_tokens)
                self.completed = True
                return
            if not isinstance(frame, frames.KVFrame):
                raise FrameError("a second handshake in one KV stream")
            layer, start, count = frame.layer, frame.block_start, frame.block_count
            if layer >= num_layers:
                raise FrameError(f"layer {layer} out of range (model has {num_layers})")
            if start + count > num_blocks:
                raise FrameError(
                    f"blocks [{start}, {start + count}) of layer {layer} out of range "
                    f"(the sequence has {num_blocks})"
                )
            if start != next_block[layer]:
                what = (
                    "duplicate layer" if next_block[layer] == num_blocks else "blocks out of order"
                )
                raise FrameError(
                    f"{what}: layer {layer} frame starts at block {start}, "
                    f"expected {next_block[layer]}"
                )
            with torch.cuda.stream(copies) if copies is not None else contextlib.nullcontext():
                k, v, k_scale, v_scale = decode_chunk(
                    frame.payload, count, spec, cache.dtype, cache.device
                )
                if on_cpu:
                    ids = _runs(lease.block_ids, start, count)
                else:
                    ids = block_ids[start : start + count]
                leases.write(lease, _store, cache, layer, ids, k, v, k_scale, v_scale)
            next_block[layer] += count
            num_kv_frames += 1
            self.payload_bytes += memoryview(frame.payload).nbytes
        raise FrameError("KV stream truncated: it ended before the final frame")


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


def _runs(block_ids: list[int], start: int, count: int) -> list[tuple[int, int, int]]:
    """Blocks ``start .. start+count`` of a sequence as runs of consecutive cache blocks:
    (first cache block, first index in the frame, length)."""
    runs: list[tuple[int, int, int]] = []
    for i in range(count):
        block = block_ids[start + i]
        if runs and runs[-1][0] + runs[-1][2] == block:
            first, src, n = runs[-1]
            runs[-1] = (first, src, n + 1)
        else:
            runs.append((block, i, 1))
    return runs


def _np_rows(t: torch.Tensor):
    """A contiguous CPU tensor [blocks, ...] as a numpy uint8 array [blocks, bytes] (a view)."""
    return t.reshape(t.shape[0], -1).view(torch.uint8).numpy()


def _store(
    cache: PagedKVCache,
    layer: int,
    ids: torch.Tensor | list[tuple[int, int, int]],
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    pairs = [(cache.k[layer], k), (cache.v[layer], v)]
    if cache.is_fp8:
        pairs += [(cache.k_scale[layer], k_scale), (cache.v_scale[layer], v_scale)]
    if isinstance(ids, list):
        # CPU cache: numpy slice copies per run of consecutive blocks, straight from the
        # received buffer. They are plain memcpys on this thread with the GIL released
        # (torch's own copies fan out to its intra-op pool, which on a busy host is many times
        # slower than one thread).
        for dst, src in pairs:
            dst_rows, src_rows = _np_rows(dst), _np_rows(src)
            for first, offset, n in ids:
                dst_rows[first : first + n] = src_rows[offset : offset + n]
        return

    # Other devices: index_put_ on [blocks, row] views, one vectorised scatter of whole
    # blocks (index_copy_ has no fp8 kernels).
    def rows(t: torch.Tensor) -> torch.Tensor:
        # Move 8-byte words: the scatter's cost is per element, and the bytes are the same.
        t = t.reshape(t.shape[0], -1).view(torch.uint8)
        return t.view(torch.int64) if t.shape[1] % 8 == 0 else t

    for dst, src in pairs:
        rows(dst).index_put_((ids,), rows(src))
