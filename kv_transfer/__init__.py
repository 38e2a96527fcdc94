"""KV cache transfer from prefill to decode workers: FP8 block codec, frame format with a
handshake, gRPC sender and receiver, and leases on the decode side's blocks.

Prefill side: ``KVSender(address, token).open(...)`` → ``TransferStream.send_layer`` per layer
(from the model's ``layer_done`` hook) → ``finish(first_token)``. Decode side:
``LeaseTable.reserve`` before prefill starts, ``KVReceiverServer`` writes the blocks in.
"""

from __future__ import annotations

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
from kv_transfer.sender import KVSender, TransferResult, TransferStream

__all__ = [
    "PROTOCOL_VERSION",
    "FrameError",
    "Handshake",
    "HandshakeError",
    "KVReceiverServer",
    "KVSender",
    "KVTransferError",
    "Lease",
    "LeaseError",
    "LeaseExpiredError",
    "LeaseStateError",
    "LeaseTable",
    "NoCapacityError",
    "TransferResult",
    "TransferStream",
]
