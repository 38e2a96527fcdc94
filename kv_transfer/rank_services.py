"""The KV transfer sides of a tensor-parallel replica's ranks 1..t-1 (engine.tp_worker's rank
services): each rank sends or receives its own KV heads, so no process gathers a replica's
whole cache (kv_transfer.sharding).

Prefill rank r: rank 0 (the prefill worker) opens each request's transfer on every rank
(``OpenTransfer``), names in each step's plan which blocks its layers ship (``Shipment``),
and aborts it on failure (``AbortTransfer``). The rank sends its heads as each layer is
done, finishes its streams after the prompt's last chunk, and reports a ``TransferOutcome``.

Decode rank r: a KV receiver over its cache and heads, its leases mirrored from rank 0's
(kv_transfer.lease_mirror); rank 0's handles list its address (``info``).

Every message is a frozen dataclass; a request's failure here becomes its outcome, never
the rank's end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine.kv_cache import PagedKVCache
from engine.tensor_parallel import ShardLayout
from engine.tp_worker import RankService
from kv_transfer.connector import KVHandle, KVSendStream
from kv_transfer.grpc_transport import GrpcRecvSide, GrpcSendSide
from kv_transfer.lease_mirror import CloseLease, MirrorLeaseTable, OpenLease
from kv_transfer.options import KVTransferOptions
from kv_transfer.sharding import RankReceiver

logger = logging.getLogger(__name__)


# ---- prefill ------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpenTransfer:
    request_id: str
    handle: KVHandle
    num_tokens: int


@dataclass(frozen=True)
class AbortTransfer:
    request_id: str
    reason: str


@dataclass(frozen=True)
class Shipment:
    """A step's KV to send (the plan's service data): per request, blocks [first_block, ...)
    of the sequence, by cache block id; and the requests whose last chunk this step is."""

    ships: tuple[tuple[str, tuple[int, ...], int], ...]  # (request id, block ids, first block)
    finishes: tuple[str, ...] = ()


@dataclass(frozen=True)
class TransferOutcome:
    request_id: str
    error: str | None
    payload_bytes: int = 0


@dataclass(frozen=True)
class PrefillRanks:
    """The rank service factory of a tensor-parallel prefill replica."""

    kv: KVTransferOptions

    def __call__(self, rank: int, cache: PagedKVCache, layout: ShardLayout, reply) -> RankService:
        return PrefillRankService(self.kv, rank, cache, layout, reply)


class PrefillRankService(RankService):
    def __init__(
        self,
        kv: KVTransferOptions,
        rank: int,
        cache: PagedKVCache,
        layout: ShardLayout,
        reply: Callable[[Any], None],
    ) -> None:
        self.rank = rank
        self.cache = cache
        self.reply = reply
        fingerprint = layout.config.fingerprint()
        self.send = GrpcSendSide(cache, fingerprint, kv, rank, layout.kv_heads_by_rank())
        self.streams: dict[str, KVSendStream] = {}  # open, not failed
        self.finishing = ThreadPoolExecutor(4, thread_name_prefix=f"kv-finish-rank{rank}")

    def handle(self, payload: Any) -> None:
        if isinstance(payload, OpenTransfer):
            try:
                stream = self.send.open(payload.handle, payload.request_id, payload.num_tokens)
            except Exception as err:  # noqa: BLE001 - the request's failure, not the rank's
                self._failed(payload.request_id, f"could not open the KV streams: {err}")
                return
            self.streams[payload.request_id] = stream
        elif isinstance(payload, AbortTransfer):
            stream = self.streams.pop(payload.request_id, None)
            if stream is not None:
                stream.abort(payload.reason)
        else:
            raise TypeError(f"unexpected message for a prefill rank: {payload!r}")

    def layer_hook(self, step_data: Shipment) -> Callable[[int], None] | None:
        device = self.cache.device
        ships = [
            (request_id, torch.tensor(blocks, dtype=torch.int64, device=device), first)
            for request_id, blocks, first in step_data.ships
            if request_id in self.streams
        ]
        if not ships:
            return None

        def layer_done(layer: int) -> None:
            for request_id, blocks, first in ships:
                stream = self.streams.get(request_id)
                if stream is None:
                    continue  # failed at an earlier layer
                try:
                    stream.send_layer(layer, blocks, first)
                except Exception as err:  # noqa: BLE001 - the stream broke: fail its request
                    self.streams.pop(request_id, None)
                    stream.abort(str(err))
                    self._failed(request_id, f"KV transfer failed: {err}")

        return layer_done

    def after_forward(self, step_data: Shipment) -> None:
        for request_id in step_data.finishes:
            stream = self.streams.pop(request_id, None)
            if stream is not None:  # the receiver's verdict comes off the rank's loop
                self.finishing.submit(self._finish, request_id, stream)

    def _finish(self, request_id: str, stream: KVSendStream) -> None:
        try:
            result = stream.finish(None)
        except Exception as err:  # noqa: BLE001 - the receiver refused, or the channel broke
            self._failed(request_id, f"KV transfer failed: {err}")
            return
        self.reply(TransferOutcome(request_id, None, result.payload_bytes))

    def _failed(self, request_id: str, message: str) -> None:
        self.reply(TransferOutcome(request_id, f"rank {self.rank}: {message}"))

    def stop(self) -> None:
        for stream in self.streams.values():
            stream.abort("the prefill rank stops")
        self.finishing.shutdown(wait=False, cancel_futures=True)
        self.send.close()


# ---- decode -------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeRanks:
    """The rank service factory of a tensor-parallel decode replica."""

    kv: KVTransferOptions

    def __call__(self, rank: int, cache: PagedKVCache, layout: ShardLayout, reply) -> RankService:
        return DecodeRankService(self.kv, cache, layout, reply)


class DecodeRankService(RankService):
    def __init__(
        self,
        kv: KVTransferOptions,
        cache: PagedKVCache,
        layout: ShardLayout,
        reply: Callable[[Any], None],
    ) -> None:
        self.heads = (layout.kv_heads.start, layout.kv_heads.stop)
        self.leases = MirrorLeaseTable(reply)
        self.receiver = GrpcRecvSide(layout.config.fingerprint(), kv, kv_heads=self.heads)
        self.receiver.start(cache, self.leases)

    def info(self) -> RankReceiver:
        return RankReceiver(self.receiver.server.address, self.heads)

    def handle(self, payload: Any) -> None:
        if isinstance(payload, OpenLease):
            self.leases.adopt(payload)
        elif isinstance(payload, CloseLease):
            self.leases.close(payload)
        else:
            raise TypeError(f"unexpected message for a decode rank: {payload!r}")

    def after_forward(self, step_data: Any) -> None:
        pass  # its KV arrives off the steps

    def stop(self) -> None:
        self.receiver.stop()
