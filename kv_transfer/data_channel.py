"""The gRPC transport's optional data channel: a raw TCP (TLS when the gRPC port is) connection
per stream that carries its kv frames, negotiated in the gRPC handshake (kv_transfer.frames).

Receiver side: :class:`DataListener` accepts connections, checks their preamble (token,
one-use ticket) and hands each to the stream that issued the ticket; :func:`receive_frames`
reads a stream's frames ahead, each kv payload straight into the cache blocks it is for where
the stream says where (``place``), other frames into reused buffers. Sender side:
:func:`connect` and :func:`send_frame`.
"""

from __future__ import annotations

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kv_transfer import wire
from kv_transfer.errors import FrameError

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the largest frame either channel accepts
PREAMBLE_TIMEOUT_S = 5.0
POLL_S = 0.25  # how often a blocked receive looks at the call's state
_DATA_BUFFERS = 3  # receive buffers per data channel (frames read ahead of the one stored)
# A frame's first bytes, read before the rest to find where its payload goes: its meta (a
# kv frame's is ~70 bytes) and the payload's length. A frame this small is read whole.
_HEAD_BYTES = 256
_IOV_MAX = 512  # buffers per recvmsg_into call (Linux takes up to 1,024)

# Where a kv frame's payload goes, asked by the reader once the frame's meta has come:
# place(meta, payload length, fill) calls fill(views) (the views' sizes add up to the
# length; fill receives the payload into them, in order) and returns the views, or returns
# None without calling it: the frame is then received into a buffer and checked whole.
Place = Callable[[bytes, int, Callable[[list], None]], list | None]


@dataclass
class Slot:
    """A data connection a stream waits for, by ticket."""

    ready: threading.Event = field(default_factory=threading.Event)
    conn: socket.socket | None = None


class DataListener:
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
        self._slots: dict[str, Slot] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kv-data-accept", daemon=True)
        self._thread.start()

    def expect(self) -> tuple[str, Slot]:
        ticket = secrets.token_urlsafe(18)
        slot = Slot()
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
            conn.settimeout(PREAMBLE_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
            magic = recv_exact(conn, len(wire.DATA_MAGIC))
            if magic != wire.DATA_MAGIC:
                raise PermissionError("not a KV data connection")
            auth = recv_exact(conn, struct.unpack("<H", recv_exact(conn, 2))[0])
            ticket = recv_exact(conn, struct.unpack("<H", recv_exact(conn, 2))[0])
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
        conn.settimeout(POLL_S)
        slot.conn = conn
        slot.ready.set()


def recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        got = conn.recv_into(view)
        if got == 0:
            raise ConnectionError("connection closed during the preamble")
        view = view[got:]
    return bytes(buf)


def tls_context(cert: bytes, key: bytes) -> ssl.SSLContext:
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


def connect(
    host: str,
    port: int,
    token: str,
    ticket: str,
    timeout_s: float,
    tls: ssl.SSLContext | None = None,
    server_name: str | None = None,
) -> socket.socket:
    """A sender's authenticated data connection for one stream."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=server_name or host)
        sock.sendall(wire.data_preamble(token, ticket))
    except BaseException:
        sock.close()
        raise
    return sock


def send_frame(sock: socket.socket, frame) -> None:
    """Write one encoded kv frame (meta, payload parts, crc) with its length prefix, straight
    from the parts' memory (``sendmsg``; TLS sockets have none)."""
    meta, parts, crc = frame
    buffers = wire.wire_parts(meta, parts, crc, length_prefix=True)
    if isinstance(sock, ssl.SSLSocket):
        for buf in buffers:
            sock.sendall(buf)
        return
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def receive_frames(
    conn: socket.socket,
    check_alive: Callable[[], None],
    close: Callable[[], None],
    place: Place | None = None,
) -> Iterator[wire.WireFrame]:
    """A stream's frames from its data connection, until the zero length that ends them. A
    reader thread receives them while the caller checks and stores the previous one: a kv
    frame's payload where ``place`` puts it (the frame's payload is then ``wire.Landed``:
    not yet checked), every other frame into a few reused buffers; each frame is valid until
    the next is asked for. ``check_alive`` raises when the stream is dead; ``close``
    unblocks the reader's receive."""

    def receive(call: Callable[[], int]) -> int:
        while True:
            try:
                got = call()
            except TimeoutError:
                check_alive()
                continue
            except OSError as err:
                raise FrameError(f"KV data connection broken: {err}") from None
            if got == 0:
                raise FrameError("KV data channel truncated: the connection closed mid-stream")
            return got

    def recv_into(view: memoryview) -> None:
        while view:
            view = view[receive(lambda v=view: conn.recv_into(v)) :]

    def recv_views(views: list[memoryview]) -> None:
        if isinstance(conn, ssl.SSLSocket):  # no recvmsg_into
            for view in views:
                recv_into(view)
            return
        first = 0
        while first < len(views):
            batch = views[first : first + _IOV_MAX]
            got = receive(lambda b=batch: conn.recvmsg_into(b)[0])
            while first < len(views) and got >= views[first].nbytes:
                got -= views[first].nbytes
                first += 1
            if got:
                views[first] = views[first][got:]

    def land(head: memoryview, size: int) -> wire.WireFrame | None:
        """The frame whose first bytes are ``head``, its payload received where ``place``
        puts it; None where it puts nothing (nothing more has been read)."""
        span = wire.payload_span(head)
        if span is None:
            return None
        tag, start, length = span
        if start + length <= head.nbytes or start + length > size:
            return None  # all in the head already, or runs past the frame: read it whole
        prefix = bytes(head[:tag])  # the meta field
        parsed = wire.parse_wire(prefix)
        if parsed.error:
            return None
        landed: list[memoryview] = []

        def fill(views: list) -> None:
            targets = [memoryview(v).cast("B") for v in views]
            if sum(t.nbytes for t in targets) != length:
                raise FrameError(f"a kv payload of {length} bytes placed in views of another size")
            landed.extend(targets)
            inline, rest = head[start:], []
            for target in targets:  # the payload's first bytes came with the head
                n = min(inline.nbytes, target.nbytes)
                target[:n] = inline[:n]
                inline = inline[n:]
                if n < target.nbytes:
                    rest.append(target[n:])
            recv_views(rest)

        if place(bytes(parsed.meta), length, fill) is None:
            return None
        tail = memoryview(bytearray(size - start - length))  # the crc field
        recv_into(tail)
        frame = wire.parse_wire(prefix + bytes(tail))
        if frame.error or frame.payload:
            return wire.WireFrame(b"", b"", 0, frame.error or "two payload fields")
        return wire.WireFrame(frame.meta, wire.Landed(tuple(landed), length), frame.crc32)

    free: queue.Queue = queue.Queue()
    for _ in range(_DATA_BUFFERS):
        free.put(memoryview(bytearray(0)))
    ready: queue.Queue = queue.Queue()
    stop = threading.Event()

    def read() -> None:
        header = memoryview(bytearray(4))
        head = memoryview(bytearray(_HEAD_BYTES))
        try:
            while not stop.is_set():
                try:
                    buf = free.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                recv_into(header)
                size = int.from_bytes(header, "little")
                if size == 0:
                    ready.put(None)
                    return
                if size > MAX_MESSAGE_BYTES:
                    raise FrameError(f"data frame of {size} bytes (limit {MAX_MESSAGE_BYTES})")
                got, frame = 0, None
                if place is not None and size > _HEAD_BYTES:
                    recv_into(head)
                    got, frame = _HEAD_BYTES, land(head, size)
                if frame is None:
                    if size > buf.nbytes:
                        buf = memoryview(bytearray(size))
                    buf[:got] = head[:got]
                    recv_into(buf[got:size])
                ready.put((buf, size, frame))
        except BaseException as err:  # handed to the caller's thread, which raises it
            ready.put(err)

    reader = threading.Thread(target=read, name="kv-data-reader", daemon=True)
    reader.start()
    try:
        while True:
            try:
                item = ready.get(timeout=POLL_S)
            except queue.Empty:
                check_alive()
                continue
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            buf, size, frame = item
            yield frame if frame is not None else wire.parse_wire(buf[:size])
            free.put(buf)
    finally:
        stop.set()
        if reader.is_alive():
            close()
            reader.join()
