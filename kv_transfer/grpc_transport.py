"""The gRPC transport (registered as "grpc", the default): the connector's two sides over
:class:`KVSender` (kv_transfer.sender) and :class:`KVReceiverServer` (kv_transfer.receiver).

The send side keeps one sender (one gRPC channel) per receiver address, made on first use and
shared by every request to it. The handle is the lease id and the receiver's gRPC address.

Between tensor-parallel replicas every rank has a side of its own: each prefill rank's send
side opens one stream per decode rank it owes KV heads (kv_transfer.sharding) and sends each
layer's blocks sliced to those heads; each decode rank's receive side fills its own heads,
and rank 0's handle lists every rank's receiver.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import LayerKV, PagedKVCache
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
from kv_transfer.sharding import HeadRange, RankReceiver, routes

NAME = "grpc"


@dataclass(frozen=True)
class _Part:
    """One stream of a transfer: to one receiver, some of this cache's KV heads."""

    stream: TransferStream
    heads: slice  # of this cache's heads
    carries_first_token: bool


class GrpcSendStream(KVSendStream):
    """One request's transfer: a stream per receiver this rank owes KV heads (one stream
    between tp 1 replicas); none for a rank whose heads another rank sends."""

    transport = NAME

    def __init__(self, cache: PagedKVCache, parts: list[_Part], request_id: str) -> None:
        self._cache = cache
        self._parts = parts
        self._request_id = request_id

    def send_layer(self, layer: int, block_ids: torch.Tensor, first_block: int = 0) -> None:
        if not self._parts:
            return
        # A gathered copy, so the frames may be sent straight from its memory (no second copy).
        blocks = self._cache.gather(layer, block_ids)
        for part in self._parts:
            heads = self._heads(blocks, part.heads)
            part.stream.send_layer(layer, *heads, first_block=first_block, copy=False)

    def send_layers(
        self, first_layer: int, layer_count: int, block_ids: torch.Tensor, first_block: int = 0
    ) -> None:
        if not self._parts:
            return
        # One gathered copy of all the layers, encoded in one pass, sent as whole-layer frames.
        blocks = self._cache.gather_layers(first_layer, layer_count, block_ids)
        for part in self._parts:
            heads = self._heads(blocks, part.heads)
            part.stream.send_layers(first_layer, *heads, first_block=first_block, copy=False)

    def _heads(self, blocks: LayerKV, heads: slice) -> tuple:
        """(k, v, k_scale, v_scale) of gathered blocks, one layer's or several ([..., Hkv, D],
        scales [..., Hkv]), cut to one receiver's ``heads`` (contiguous copies) unless that
        is all of them."""
        tensors = (blocks.k, blocks.v, blocks.k_scale, blocks.v_scale)
        if heads == slice(0, self._cache.num_kv_heads):
            return tensors
        k, v, ks, vs = tensors
        k, v = k[..., heads, :].contiguous(), v[..., heads, :].contiguous()
        if ks is not None:
            ks, vs = ks[..., heads].contiguous(), vs[..., heads].contiguous()
        return k, v, ks, vs

    def finish(self, first_token: int | None, fork_tokens: Sequence[int] = ()) -> TransferResult:
        results = []
        for part in self._parts:
            if part.carries_first_token:
                results.append(part.stream.finish(first_token, fork_tokens))
            else:
                results.append(part.stream.finish(None))
        return TransferResult(
            request_id=self._request_id,
            lease_id=results[0].lease_id if results else "",
            payload_bytes=sum(r.payload_bytes for r in results),
            kv_bytes=sum(r.kv_bytes for r in results),
            num_frames=sum(r.num_frames for r in results),
            seconds=max((r.seconds for r in results), default=0.0),
        )

    def abort(self, reason: str) -> None:
        for part in self._parts:
            part.stream.abort(reason)


class GrpcSendSide(KVSendSide):
    """``rank`` / ``heads_by_rank``: this prefill rank and every rank's KV heads, for a
    tensor-parallel replica (default: tp 1, all heads here)."""

    transport = NAME

    def __init__(
        self,
        cache: PagedKVCache,
        fingerprint: dict,
        options: KVTransferOptions,
        rank: int = 0,
        heads_by_rank: tuple[HeadRange, ...] | None = None,
    ) -> None:
        self._cache = cache
        self._fingerprint = fingerprint
        self._options = options
        self._num_heads = int(fingerprint["num_kv_heads"])
        self._rank = rank
        self._heads_by_rank = heads_by_rank or ((0, self._num_heads),)
        self._senders: dict[str, KVSender] = {}
        self._lock = threading.Lock()

    def open(self, handle: KVHandle, request_id: str, num_tokens: int) -> GrpcSendStream:
        self._check_transport(handle)
        receivers = handle.receivers or (RankReceiver(handle.address, (0, self._num_heads)),)
        try:
            plan = routes(self._heads_by_rank, [r.heads for r in receivers])
        except ValueError as err:
            raise KVTransferError(f"KV layouts do not meet: {err}", "FAILED_PRECONDITION") from None
        first = self._heads_by_rank[self._rank][0]
        parts: list[_Part] = []
        try:
            for route in (r for r in plan if r.sender == self._rank):
                whole = route.heads == (0, self._num_heads)
                stream = self._open_stream(
                    handle,
                    request_id,
                    num_tokens,
                    self._options.wire_dtype,
                    address=receivers[route.receiver].address,
                    heads=None if whole else route.heads,
                )
                heads = slice(route.heads[0] - first, route.heads[1] - first)
                parts.append(_Part(stream, heads, self._rank == 0 and route.receiver == 0))
        except BaseException:
            for part in parts:
                part.stream.abort("a sibling stream failed to open")
            raise
        return GrpcSendStream(self._cache, parts, request_id)

    def _open_stream(
        self,
        handle: KVHandle,
        request_id: str,
        num_tokens: int,
        wire_dtype: str,
        address: str | None = None,
        **extra,
    ) -> TransferStream:
        """The gRPC stream of one transfer to ``handle``'s lease, at ``address`` (default:
        the handle's); a transport built on this one passes its handshake fields in
        ``extra``."""
        self._check_transport(handle)
        cache = self._cache
        return self._sender(address or handle.address).open(
            request_id,
            handle.lease_id,
            self._fingerprint,
            cache.block_size,
            num_tokens,
            cache.num_layers,
            wire_dtype,
            cache.dtype,
            first_block=handle.first_block,
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
                    data_channel_min_bytes=options.data_channel_min_bytes,
                )
            return sender


class GrpcRecvSide(KVRecvSide):
    """``kv_heads``: the model's KV heads this rank's cache holds (default: all);
    ``peers``: the other ranks' receivers of a tensor-parallel replica (rank 0 lists them
    in its handles)."""

    transport = NAME

    def __init__(
        self,
        fingerprint: dict,
        options: KVTransferOptions,
        kv_heads: HeadRange | None = None,
        peers: tuple[RankReceiver, ...] = (),
    ) -> None:
        self._fingerprint = fingerprint
        self._options = options
        self._kv_heads = kv_heads
        self._peers = peers
        self.server: KVReceiverServer | None = None

    def start(self, cache: PagedKVCache, leases: LeaseTable) -> None:
        options = self._options
        self.server = KVReceiverServer(
            cache,
            leases,
            self._fingerprint,
            host=options.bind_host(),
            advertised_host=options.advertised_host(),
            port=0,
            token=options.token,
            tls_cert=options.tls_cert,
            tls_key=options.tls_key,
            kv_heads=self._kv_heads,
            **{"data_channel": options.data_channel, **self._server_options(cache)},
        )
        self.server.start()

    def _server_options(self, cache: PagedKVCache) -> dict:
        """What a transport built on this one adds to the receiver server."""
        return {}

    def handle_for(self, lease: Lease) -> KVHandle:
        if self.server is None:
            raise KVTransferError("the KV receiver is not started", "UNAVAILABLE")
        if not self._peers:
            return KVHandle(self.transport, lease.lease_id, self.server.address)
        mine = RankReceiver(self.server.address, self.server.kv_heads)
        return KVHandle(self.transport, lease.lease_id, mine.address, (mine, *self._peers))

    def stats(self) -> ReceiverStats:
        return ReceiverStats() if self.server is None else self.server.stats

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


register_transport(Transport(NAME, GrpcSendSide, GrpcRecvSide))
