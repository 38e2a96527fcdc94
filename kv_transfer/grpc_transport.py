"""The gRPC transport (registered as "grpc", the default): the connector's two sides over
:class:`KVSender` (kv_transfer.sender) and :class:`KVReceiverServer` (kv_transfer.receiver).

The send side keeps one sender (one gRPC channel) per receiver address, made on first use and
shared by every request to it. The handle is the lease id and the receiver's gRPC address.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from engine.kv_cache import PagedKVCache
from kv_transfer.connector import (
    KVHandle,
    KVRecvSide,
    KVSendSide,
    KVSendStream,
    ReceiverStats,
    TransferResult,
    Transport,
    register_transport,
)
from kv_transfer.errors import KVTransferError
from kv_transfer.lease import Lease, LeaseTable
from kv_transfer.options import KVTransferOptions
from kv_transfer.receiver import KVReceiverServer
from kv_transfer.sender import KVSender, TransferStream

NAME = "grpc"


class GrpcSendStream(KVSendStream):
    transport = NAME

    def __init__(self, cache: PagedKVCache, stream: TransferStream) -> None:
        self._cache = cache
        self._stream = stream

    def send_layer(self, layer: int, block_ids: torch.Tensor, first_block: int = 0) -> None:
        # A gathered copy, so the frames may be sent straight from its memory (no second copy).
        blocks = self._cache.gather(layer, block_ids)
        self._stream.send_layer(
            layer,
            blocks.k,
            blocks.v,
            blocks.k_scale,
            blocks.v_scale,
            first_block=first_block,
            copy=False,
        )

    def finish(self, first_token: int, fork_tokens: Sequence[int] = ()) -> TransferResult:
        return self._stream.finish(first_token, fork_tokens)

    def abort(self, reason: str) -> None:
        self._stream.abort(reason)


class GrpcSendSide(KVSendSide):
    transport = NAME

    def __init__(self, cache: PagedKVCache, fingerprint: dict, options: KVTransferOptions) -> None:
        self._cache = cache
        self._fingerprint = fingerprint
        self._options = options
        self._senders: dict[str, KVSender] = {}
        self._lock = threading.Lock()

    def open(self, handle: KVHandle, request_id: str, num_tokens: int) -> GrpcSendStream:
        stream = self._open_stream(handle, request_id, num_tokens, self._options.wire_dtype)
        return GrpcSendStream(self._cache, stream)

    def _open_stream(
        self, handle: KVHandle, request_id: str, num_tokens: int, wire_dtype: str, **extra
    ) -> TransferStream:
        """The gRPC stream of one transfer to ``handle``'s lease (a transport built on this
        one passes its handshake fields in ``extra``)."""
        self._check_transport(handle)
        cache = self._cache
        return self._sender(handle.address).open(
            request_id,
            handle.lease_id,
            self._fingerprint,
            cache.block_size,
            num_tokens,
            cache.num_layers,
            wire_dtype,
            cache.dtype,
            **extra,
        )

    def _check_transport(self, handle: KVHandle) -> None:
        if handle.transport != self.transport:
            raise KVTransferError(
                f"a {handle.transport!r} KV handle reached the {self.transport!r} transport: the "
                "prefill and decode pools must use the same kv.transport",
                "FAILED_PRECONDITION",
            )

    def close(self) -> None:
        with self._lock:
            senders, self._senders = list(self._senders.values()), {}
        for sender in senders:
            sender.close()

    def _sender(self, address: str) -> KVSender:
        options = self._options
        with self._lock:
            sender = self._senders.get(address)
            if sender is None:
                sender = self._senders[address] = KVSender(
                    address,
                    options.token,
                    tls_root_cert=options.tls_cert,
                    max_frames_in_flight=options.max_frames_in_flight,
                    timeout_s=options.lease_timeout_s,
                    data_channel=options.data_channel,
                )
            return sender


class GrpcRecvSide(KVRecvSide):
    transport = NAME

    def __init__(self, fingerprint: dict, options: KVTransferOptions) -> None:
        self._fingerprint = fingerprint
        self._options = options
        self.server: KVReceiverServer | None = None

    def start(self, cache: PagedKVCache, leases: LeaseTable) -> None:
        options = self._options
        self.server = KVReceiverServer(
            cache,
            leases,
            self._fingerprint,
            host=options.host,
            port=0,
            token=options.token,
            tls_cert=options.tls_cert,
            tls_key=options.tls_key,
            **{"data_channel": options.data_channel, **self._server_options(cache)},
        )
        self.server.start()

    def _server_options(self, cache: PagedKVCache) -> dict:
        """What a transport built on this one adds to the receiver server."""
        return {}

    def handle_for(self, lease: Lease) -> KVHandle:
        if self.server is None:
            raise KVTransferError("the KV receiver is not started", "UNAVAILABLE")
        return KVHandle(self.transport, lease.lease_id, self.server.address)

    def stats(self) -> ReceiverStats:
        return ReceiverStats() if self.server is None else self.server.stats

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


register_transport(Transport(NAME, GrpcSendSide, GrpcRecvSide))
