"""KV cache transfer from prefill to decode workers: the connector interface (send side,
receive side, opaque handles; kv_transfer.connector), its transports (gRPC, the default),
the FP8 block codec, the frame format with a handshake, and leases on the decode side's blocks.

Prefill side: ``transport(name).send_side(cache, fingerprint, options).open(handle, ...)`` →
``send_layer`` per layer (from the model's layer hook) → ``finish(first_token)``. Decode side:
``LeaseTable.reserve`` before prefill starts, then ``recv_side.handle_for(lease)``; the receive
side writes the blocks in.
"""

from __future__ import annotations

from kv_transfer.connector import (
    KVHandle,
    KVRecvSide,
    KVSendSide,
    KVSendStream,
    ReceiverStats,
    TransferResult,
    transport,
    transport_names,
)
from kv_transfer.errors import (
    FrameError,
    HandshakeError,
    KVTransferError,
    LeaseError,
    LeaseExpiredError,
    LeaseStateError,
    NoCapacityError,
)
from kv_transfer.frames import PROTOCOL_VERSION, Handshake
from kv_transfer.lease import Lease, LeaseTable
from kv_transfer.receiver import KVReceiverServer
from kv_transfer.sender import KVSender, TransferStream

__all__ = [
    "PROTOCOL_VERSION",
    "FrameError",
    "Handshake",
    "HandshakeError",
    "KVHandle",
    "KVReceiverServer",
    "KVRecvSide",
    "KVSendSide",
    "KVSendStream",
    "KVSender",
    "KVTransferError",
    "Lease",
    "LeaseError",
    "LeaseExpiredError",
    "LeaseStateError",
    "LeaseTable",
    "NoCapacityError",
    "ReceiverStats",
    "TransferResult",
    "TransferStream",
    "transport",
    "transport_names",
]
