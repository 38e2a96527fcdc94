"""Errors of the KV transfer, each carrying the gRPC status code it maps to.

The receiver turns a :class:`KVTransferError` raised while handling a stream into that status
(with the message as details); the sender raises one built from the status it got back, so
both sides speak the same codes. ``code`` is a ``grpc.StatusCode`` name (a string, so this
module does not depend on grpc).
"""

from __future__ import annotations


class KVTransferError(Exception):
    """A transfer failed or was refused. ``code`` names the gRPC status (e.g. "NOT_FOUND")."""

    code = "UNKNOWN"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class FrameError(KVTransferError):
    """A frame is malformed: bad checksum, bad metadata, wrong sizes, wrong order."""

    code = "INVALID_ARGUMENT"


class HandshakeError(KVTransferError):
    """The two sides cannot exchange KV blocks: model, block size, dtype or protocol differ."""

    code = "FAILED_PRECONDITION"


class LeaseError(KVTransferError):
    """The lease named by a transfer is unknown, expired or released."""

    code = "NOT_FOUND"


class LeaseStateError(LeaseError):
    """The lease exists but cannot take this transfer (already receiving or complete, or it
    belongs to another request)."""

    code = "FAILED_PRECONDITION"


class LeaseExpiredError(LeaseError):
    """The lease's deadline passed while its transfer was under way."""

    code = "DEADLINE_EXCEEDED"


class NoCapacityError(KVTransferError):
    """The decode worker's cache has too few free blocks for a reservation."""

    code = "RESOURCE_EXHAUSTED"
