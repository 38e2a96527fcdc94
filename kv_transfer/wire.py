"""A KV frame's bytes on the wire: the protobuf ``Frame`` message of protos/kv_transfer.proto,
built and parsed by hand (:func:`wire_parts`, :func:`parse_wire`) so a payload is never copied
into or out of a protobuf object: it is sent from the tensors' memory and received as a
``memoryview`` of the message buffer. Also the data channel's preamble (kv_transfer.frames
describes the protocol)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

# Frame { bytes meta = 1; bytes payload = 2; fixed32 crc32 = 3; }: tags 0x0a, 0x12, 0x1d.
_META_TAG, _PAYLOAD_TAG, _CRC_TAG = 0x0A, 0x12, 0x1D
DATA_MAGIC = b"PDKV\x01"
_U32 = struct.Struct("<I")


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def wire_parts(
    meta: bytes, payload_parts: Sequence, crc: int, *, length_prefix: bool = False
) -> list:
    """The protobuf serialisation of ``Frame(meta, payload=b"".join(payload_parts), crc32)``
    as a list of buffers whose concatenation is the message: a small header, the payload parts
    themselves (not copied), the crc field. ``length_prefix`` puts the message's length (u32
    little-endian) in front, as the data channel frames it."""
    payload_len = sum(memoryview(p).nbytes for p in payload_parts)
    head = bytearray()
    if meta:
        head.append(_META_TAG)
        head += _varint(len(meta))
        head += meta
    if payload_len:
        head.append(_PAYLOAD_TAG)
        head += _varint(payload_len)
    tail = bytes((_CRC_TAG,)) + _U32.pack(crc)
    if length_prefix:
        head[0:0] = _U32.pack(len(head) + payload_len + len(tail))
    return [bytes(head), *(p for p in payload_parts if memoryview(p).nbytes), tail]


def serialize_wire(frame) -> bytes:
    """gRPC request serializer of the sender: (meta, payload parts, crc) → Frame bytes, with
    one copy of the payload (the join)."""
    meta, parts, crc = frame
    if isinstance(parts, (bytes, bytearray, memoryview)):
        parts = (parts,)
    return b"".join(wire_parts(meta, parts, crc))


@dataclass(frozen=True, slots=True)
class WireFrame:
    """A received Frame message, its fields views of the received buffer (no copies).
    ``error`` says why the buffer is not a valid Frame encoding (the fields are then empty)."""

    meta: memoryview | bytes
    payload: memoryview | bytes | Landed
    crc32: int
    error: str | None = None


_EMPTY = memoryview(b"")


@dataclass(frozen=True, slots=True)
class Landed:
    """A kv frame's payload that the receiver wrote straight into the lease's cache blocks
    as it came off the data channel (data_channel.receive_frames): its bytes there, in
    payload order. The frame's checksum is taken over them before the lease can complete."""

    parts: tuple[memoryview, ...]  # contiguous byte views of the cache's blocks
    nbytes: int


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ValueError("truncated or overlong varint")


def parse_wire(data) -> WireFrame:
    """Parse one serialised Frame (any valid protobuf encoding: fields in any order, absent
    fields, unknown fields skipped, last value wins). Never raises: a malformed buffer comes
    back with ``error`` set, for the receiver to refuse with a clear status."""
    buf = memoryview(data)
    if buf.ndim != 1 or buf.itemsize != 1:
        buf = buf.cast("B")
    meta = payload = _EMPTY
    crc = 0
    pos, end = 0, len(buf)
    try:
        while pos < end:
            key, pos = _read_varint(buf, pos, end)
            field, wire_type = key >> 3, key & 7
            if not 0 < field < 1 << 29:
                raise ValueError(f"invalid field number {field}")
            if wire_type == 2:
                length, pos = _read_varint(buf, pos, end)
                if length > end - pos:
                    raise ValueError("length-delimited field runs past the message")
                value = buf[pos : pos + length]
                pos += length
                if field == 1:
                    meta = value
                elif field == 2:
                    payload = value
                elif field == 3:
                    raise ValueError("crc32 must be fixed32")
            elif wire_type == 5:
                if end - pos < 4:
                    raise ValueError("truncated fixed32")
                if field == 3:
                    crc = _U32.unpack_from(buf, pos)[0]
                elif field in (1, 2):
                    raise ValueError(f"field {field} must be bytes")
                pos += 4
            elif wire_type == 0:
                if field in (1, 2, 3):
                    raise ValueError(f"field {field} has the wrong wire type")
                _, pos = _read_varint(buf, pos, end)
            elif wire_type == 1:
                if field in (1, 2, 3) or end - pos < 8:
                    raise ValueError("bad fixed64 field")
                pos += 8
            else:
                raise ValueError(f"unsupported wire type {wire_type}")
    except ValueError as err:
        return WireFrame(_EMPTY, _EMPTY, 0, f"malformed Frame message: {err}")
    return WireFrame(meta, payload, crc)


def payload_span(head: memoryview) -> tuple[int, int, int] | None:
    """For a Frame message whose first bytes are ``head``, laid out as :func:`wire_parts`
    writes it (the meta field, then the payload's tag and length): (where the payload's tag
    is, where the payload starts, its length); the meta field is ``head[:tag]``. None for
    any other layout, or a head too short to tell."""
    end = len(head)
    try:
        if end < 1 or head[0] != _META_TAG:
            return None
        meta_len, pos = _read_varint(head, 1, end)
        tag = pos + meta_len
        if tag >= end or head[tag] != _PAYLOAD_TAG:
            return None
        payload_len, start = _read_varint(head, tag + 1, end)
    except ValueError:  # truncated within the head
        return None
    return tag, start, payload_len


def data_preamble(token: str, ticket: str) -> bytes:
    """What a sender writes first on a data connection: magic, then the u16-length-prefixed
    ``Bearer <token>`` and ticket."""
    auth = f"Bearer {token}".encode()
    ticket_b = ticket.encode()
    return (
        DATA_MAGIC
        + struct.pack("<H", len(auth))
        + auth
        + struct.pack("<H", len(ticket_b))
        + ticket_b
    )
