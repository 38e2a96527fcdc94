"""The decode side of the KV transfer: a gRPC server that writes incoming KV blocks straight
into the blocks a lease reserved in the decode worker's paged cache.

One ``Push`` stream = one request's cache (see :mod:`kv_transfer.frames`). The handler checks
the token, parses the handshake, attaches the stream to its lease, then for each frame checks
the metadata against what the handshake promised (layer range, block range in order, payload
size), decodes the payload outside the lock (bounded: one frame) and copies it into
``cache.k[layer]`` / ``cache.v[layer]`` at the lease's block ids under the lease table's lock.
Any refusal or a broken stream releases the lease before the status goes back; a silent peer
is caught by the lease deadline (sweeper thread) and by the RPC's deadline.

Thread-safety: gRPC runs handlers on a thread pool; handlers share only the lease table (its
lock) and the counters (their own lock). Callers: the decode worker constructs, ``start``s and
``stop``s it.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

from engine.kv_cache import PagedKVCache
from kv_transfer import frames
from kv_transfer.codec import WireSpec, decode_chunk, dtype_from_name
from kv_transfer.errors import FrameError, KVTransferError
from kv_transfer.lease import Lease, LeaseTable
from protos import kv_transfer_pb2, kv_transfer_pb2_grpc

logger = logging.getLogger(__name__)

# Frames are bounded by the sender (4 MiB by default); allow headroom for metadata and for
# senders configured with larger frames.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


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


class _Servicer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, server: KVReceiverServer) -> None:
        self.server = server

    def Push(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        return self.server._push(request_iterator, context)


class KVReceiverServer:
    """gRPC KV receiver of one decode worker.

    ``fingerprint`` is the decode model's ``ModelConfig.fingerprint()``; a sender must present
    the same. ``token`` is required from every peer (``authorization: Bearer <token>``);
    ``tls_cert``/``tls_key`` (PEM) switch the port to TLS.
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

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> int:
        """Bind, serve, start the lease sweeper. Returns the bound port."""
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=self.max_workers, thread_name_prefix="kv-receiver"
            ),
            options=grpc_options(),
        )
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(_Servicer(self), server)
        bind = f"{self.host}:{self.port}"
        if self._tls is None:
            port = server.add_insecure_port(bind)
        else:
            creds = grpc.ssl_server_credentials([(self._tls[1], self._tls[0])])
            port = server.add_secure_port(bind, creds)
        if port == 0:
            raise OSError(f"KV receiver could not bind {bind}")
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
        transfer = _Transfer(self)
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
            with self._stats_lock:
                self.stats.seconds += time.perf_counter() - start
                self.stats.bytes_received += transfer.payload_bytes
                if code is None:
                    self.stats.transfers_completed += 1
                else:
                    self.stats.transfers_failed += 1
        if code is not None:
            context.abort(code, message)
        return reply


class _Transfer:
    """State of one stream on the receiver; used by one handler thread."""

    def __init__(self, server: KVReceiverServer) -> None:
        self.server = server
        self.cache = server.cache
        self.lease: Lease | None = None
        self.completed = False
        self.payload_bytes = 0
        self.failure = "stream ended"

    def release_unless_complete(self) -> None:
        if self.lease is not None and not self.completed:
            self.server.leases.release(self.lease.lease_id, self.failure)

    def run(self, request_iterator) -> kv_transfer_pb2.PushReply:
        it = iter(request_iterator)
        first = next(it, None)
        if first is None:
            raise FrameError("empty KV stream: expected a handshake frame")
        handshake = frames.decode_frame(first.meta, first.payload, first.crc32)
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

    def _receive_layers(self, it, spec: WireSpec, lease: Lease) -> None:
        cache, leases = self.cache, self.server.leases
        num_layers, num_blocks = cache.num_layers, len(lease.block_ids)
        next_block = [0] * num_layers  # per layer: the next block index expected
        block_ids = torch.tensor(lease.block_ids, dtype=torch.int64, device=cache.device)
        num_kv_frames = 0
        for message in it:
            frame = frames.decode_frame(message.meta, message.payload, message.crc32)
            if isinstance(frame, frames.EndFrame):
                missing = [i for i, b in enumerate(next_block) if b != num_blocks]
                if missing:
                    raise FrameError(f"KV stream ended with layers {missing} missing or partial")
                if frame.num_kv_frames != num_kv_frames:
                    raise FrameError(
                        f"end frame counts {frame.num_kv_frames} kv frames, {num_kv_frames} arrived"
                    )
                leases.complete(lease, frame.first_token)
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
            k, v, k_scale, v_scale = decode_chunk(
                frame.payload, count, spec, cache.dtype, cache.device
            )
            ids = block_ids[start : start + count]
            leases.write(lease, _store, cache, layer, ids, k, v, k_scale, v_scale)
            next_block[layer] += count
            num_kv_frames += 1
            self.payload_bytes += len(frame.payload)
        raise FrameError("KV stream truncated: it ended before the final frame")


def _store(
    cache: PagedKVCache,
    layer: int,
    ids: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    # index_put_ on [blocks, row] views: one vectorised scatter of whole blocks (on CPU
    # index_copy_ is ~50x slower for these shapes, and neither has fp8 kernels).
    def rows(t: torch.Tensor) -> torch.Tensor:
        # Move 8-byte words: the scatter's cost is per element, and the bytes are the same.
        t = t.reshape(t.shape[0], -1).view(torch.uint8)
        return t.view(torch.int64) if t.shape[1] % 8 == 0 else t

    rows(cache.k[layer]).index_put_((ids,), rows(k))
    rows(cache.v[layer]).index_put_((ids,), rows(v))
    if cache.is_fp8:
        cache.k_scale[layer].index_put_((ids,), k_scale)
        cache.v_scale[layer].index_put_((ids,), v_scale)
