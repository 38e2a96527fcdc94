"""The wire format of one KV transfer: frames of msgpack metadata + raw payload + CRC32C.

A transfer (one gRPC ``Push`` stream, see ``protos/kv_transfer.proto``) is

1. a **handshake** frame (no payload): ``{"type": "handshake", "version", "request_id",
   "lease_id", "fingerprint", "block_size", "num_tokens", "wire_dtype", "payload_dtype",
   "layout", "heads"}``; the receiver refuses a mismatch before it decodes anything else.
   ``heads`` = [start, stop): the model's KV heads this stream carries (between
   tensor-parallel replicas a transfer is one stream per pair of ranks, each with some
   heads, kv_transfer.sharding); absent, all of them. ``first_block`` (absent: 0): the
   stream starts at that block, the receiver's own prefix cache holding those before it;
2. **kv** frames, per group of blocks of one layer or of consecutive layers: ``{"type": "kv",
   "layer", "block_start", "block_count"}`` and ``"layer_count"`` when more than one; per
   layer (from ``layer`` on) the payload holds the K blocks then the V blocks ``[block_count,
   block_size, heads, head_dim]`` of ``payload_dtype`` (row-major, ``LAYOUT``, the stream's
   heads), followed for fp8 by the K then V scales ``[block_count, heads]`` float32. Block
   ``i`` is the sequence's i-th block (block-table order). Within a layer the groups come in
   order and without gaps. A sender puts several layers in one frame when they are ready
   together (a backlog): each frame costs a fixed time on both sides, whatever its size;
   With the NIXL transport the handshake carries the sender's NIXL agent metadata
   (``nixl_agent``) and where its registered cache lies (``nixl_layout``: per cache tensor,
   in payload order, ``[address, layer_stride, row_bytes]``, and ``nixl_blocks``, the blocks
   per layer), and **kv_ready** frames (no payload) stand for kv frames: ``{"type":
   "kv_ready", "layer", "block_start", "block_count", "seq", "source_blocks", "nbytes",
   "data_crc"}`` (and ``"layer_count"``, as for kv frames): the same blocks' payload lies in
   the sender's cache, in its blocks ``source_blocks`` (one per sequence block) of each
   layer; the receiver READs them straight into the lease's blocks, checks ``data_crc``
   (CRC32C of those bytes, layer by layer in payload order) and notifies
   ``"<lease_id>:<seq>"`` (``seq``: the frame's number in its stream, from 0);
3. an **end** frame (no payload): ``{"type": "end", "first_token", "num_kv_frames"}``, and
   ``"fork_tokens"`` (the first tokens of the prompt's other sequences, OpenAI's ``n``) when
   there are forks. Of a sharded transfer's streams only the one from prefill rank 0 to
   decode rank 0 carries the first tokens; the others' end frames leave them out.

Every frame carries ``crc32 = CRC32C(meta + payload)`` (Castagnoli, hardware-accelerated by
the ``crc32c`` package; protocol version 1 used zlib's CRC-32, and a version-1 peer is
recognised by it and refused with a message saying so). Decoding validates types and
ranges of the metadata strictly (never trusts the peer) and raises :class:`FrameError`;
handshake compatibility raises :class:`HandshakeError`. Pure functions, thread-safe.

On the wire a frame is the protobuf ``Frame`` message of ``protos/kv_transfer.proto``, built
and parsed by hand (kv_transfer.wire).

**Data channel.** A handshake with ``"data_channel": true`` asks the receiver for a raw TCP
(or TLS) connection for the kv frames: the receiver answers with gRPC initial metadata
(``kv-data-port``, ``kv-data-ticket``); the sender connects, presents ``wire.DATA_MAGIC``, its
``Bearer`` token and the ticket (``wire.data_preamble``), then writes each kv frame as a
little-endian u32 length followed by the same ``Frame`` encoding, and a zero length when the
kv frames are done. The end frame and the status still travel on the gRPC stream. After an
offer the sender's next gRPC frame answers it: ``{"type": "data_channel", "connected"}``;
a sender that could not connect (a port the network does not let through) says false and
sends its kv frames over gRPC. A receiver that declines (``kv-data-port: none``) gets every
frame over gRPC, and no answer.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import crc32c
import msgpack

from kv_transfer.errors import FrameError, HandshakeError
from kv_transfer.wire import Landed

# 5: frames of several layers, the data channel offer answered; 4: NIXL reads the sender's
# cache in place; 3: streams of some KV heads; 2: CRC32C checksums (1: zlib CRC-32)
PROTOCOL_VERSION = 5
# Per layer, K then V, each [num_blocks, block_size, num_kv_heads, head_dim], row-major: the
# PagedKVCache layout, so a payload is a straight copy of pages.
LAYOUT = "blocks,block_size,kv_heads,head_dim"
WIRE_DTYPES = ("passthrough", "fp8")
PAYLOAD_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn")
MAX_META_BYTES = 64 * 1024

HANDSHAKE = "handshake"
KV = "kv"
END = "end"
READY = "kv_ready"
DATA_ANSWER = "data_channel"


@dataclass(frozen=True)
class Handshake:
    """What the sender promises about the stream that follows."""

    request_id: str
    lease_id: str
    fingerprint: dict[str, Any]  # ModelConfig.fingerprint()
    block_size: int
    num_tokens: int
    wire_dtype: str  # passthrough | fp8
    payload_dtype: str  # element dtype of the K/V payloads, e.g. "bfloat16", "float8_e4m3fn"
    layout: str = LAYOUT
    version: int = PROTOCOL_VERSION
    data_channel: bool = False  # the sender asks for a raw TCP data channel for kv frames
    nixl_agent: bytes = b""  # NIXL transport: the sender's agent metadata (kv_ready frames)
    # NIXL: per cache tensor of the sender (payload order) [address, layer_stride, row_bytes]
    nixl_layout: tuple[tuple[int, int, int], ...] = ()
    nixl_blocks: int = 0  # NIXL: blocks per layer of the sender's cache
    heads: tuple[int, int] | None = None  # the model's KV heads [start, stop) carried; None: all
    first_block: int = 0  # blocks before it are not sent: the receiver's cache has them

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    def head_range(self) -> tuple[int, int]:
        """The KV heads this stream carries (all of the fingerprint's when not given)."""
        return self.heads or (0, int(self.fingerprint["num_kv_heads"]))

    def to_meta(self) -> dict[str, Any]:
        meta = {"type": HANDSHAKE, **asdict(self)}
        if self.heads is None:
            del meta["heads"]
        else:
            meta["heads"] = list(self.heads)
        return meta


@dataclass(frozen=True)
class KVFrame:
    layer: int  # the first of the frame's layers
    block_start: int
    block_count: int
    payload: bytes | memoryview | Landed  # per layer, one payload of block_count blocks
    layer_count: int = 1

    @property
    def layers(self) -> range:
        return range(self.layer, self.layer + self.layer_count)


@dataclass(frozen=True)
class ReadyFrame:
    """NIXL: blocks of one layer waiting in the sender's cache (see module doc)."""

    layer: int
    block_start: int
    block_count: int
    seq: int
    source_blocks: tuple[int, ...]  # the sender's cache block of each sequence block
    nbytes: int  # of every layer's blocks
    data_crc: int
    layer_count: int = 1

    @property
    def layers(self) -> range:
        return range(self.layer, self.layer + self.layer_count)


@dataclass(frozen=True)
class EndFrame:
    first_token: int | None  # None: another stream of the transfer carries it
    num_kv_frames: int
    fork_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class DataAnswer:
    """The sender's answer to a data channel offer: whether it connected."""

    connected: bool


Frame = Handshake | KVFrame | ReadyFrame | EndFrame | DataAnswer


def checksum(meta: bytes, payload: bytes) -> int:
    return crc32c.crc32c(payload, crc32c.crc32c(meta))


def checksum_parts(meta: bytes, parts: Sequence) -> int:
    """``checksum(meta, b"".join(parts))`` without the join (each buffer read in place, the
    GIL released on large ones)."""
    crc = crc32c.crc32c(meta)
    for part in parts:
        crc = crc32c.crc32c(part, crc)
    return crc


def encode_frame(meta: dict[str, Any], payload: bytes = b"") -> tuple[bytes, bytes, int]:
    """(meta bytes, payload, crc32) of one frame."""
    packed = msgpack.packb(meta, use_bin_type=True)
    return packed, payload, checksum(packed, payload)


def encode_handshake(handshake: Handshake) -> tuple[bytes, bytes, int]:
    return encode_frame(handshake.to_meta())


def _kv_meta(kind: str, layer: int, block_start: int, block_count: int, layer_count: int):
    if layer_count < 1:
        raise ValueError(f"a frame holds at least one layer, not {layer_count}")
    meta = {"type": kind, "layer": layer, "block_start": block_start, "block_count": block_count}
    if layer_count > 1:
        meta["layer_count"] = layer_count
    return meta


def encode_kv(
    layer: int, block_start: int, block_count: int, payload: bytes, layer_count: int = 1
) -> tuple[bytes, bytes, int]:
    return encode_frame(_kv_meta(KV, layer, block_start, block_count, layer_count), payload)


def encode_kv_parts(
    layer: int, block_start: int, block_count: int, parts: Sequence, layer_count: int = 1
) -> tuple[bytes, Sequence, int]:
    """Like :func:`encode_kv`, the payload given as contiguous buffers (not joined, not
    copied): (meta bytes, payload parts, crc32)."""
    meta = _kv_meta(KV, layer, block_start, block_count, layer_count)
    packed = msgpack.packb(meta, use_bin_type=True)
    return packed, parts, checksum_parts(packed, parts)


def encode_ready(
    layer: int,
    block_start: int,
    seq: int,
    source_blocks: Sequence[int],
    data: Sequence,
    layer_count: int = 1,
) -> tuple[bytes, bytes, int]:
    """The ``seq``-th kv_ready frame of a stream: ``data`` (buffers, layer by layer in payload
    order) are the cache's blocks ``source_blocks`` of layers ``[layer, layer +
    layer_count)``, read in place by the receiver."""
    data_crc = 0
    for part in data:
        data_crc = crc32c.crc32c(part, data_crc)
    meta = _kv_meta(READY, layer, block_start, len(source_blocks), layer_count)
    meta.update(
        seq=seq,
        source_blocks=list(source_blocks),
        nbytes=sum(memoryview(p).nbytes for p in data),
        data_crc=data_crc,
    )
    return encode_frame(meta)


def encode_end(
    first_token: int | None, num_kv_frames: int, fork_tokens: Sequence[int] = ()
) -> tuple[bytes, bytes, int]:
    meta: dict[str, Any] = {"type": END, "num_kv_frames": num_kv_frames}
    if first_token is not None:
        meta["first_token"] = first_token
    if fork_tokens:
        meta["fork_tokens"] = list(fork_tokens)
    return encode_frame(meta)


def encode_data_answer(connected: bool) -> tuple[bytes, bytes, int]:
    return encode_frame({"type": DATA_ANSWER, "connected": connected})


def normalise_fingerprint(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint as it looks after a trip through msgpack (tuples become lists), so a
    local one compares equal to one received."""
    return msgpack.unpackb(msgpack.packb(fingerprint, use_bin_type=True), raw=False)


# ---- decoding -----------------------------------------------------------------------------


def _int(meta: dict, key: str, *, minimum: int = 0) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise FrameError(f"frame field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _str(meta: dict, key: str, *, max_len: int = 256) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise FrameError(f"frame field {key!r} must be a non-empty string, got {value!r}")
    return value


def _bool(meta: dict, key: str) -> bool:
    value = meta.get(key, False)
    if not isinstance(value, bool):
        raise FrameError(f"frame field {key!r} must be a boolean, got {value!r}")
    return value


def _bytes(meta: dict, key: str) -> bytes:
    value = meta.get(key, b"")
    if not isinstance(value, bytes):
        raise FrameError(f"frame field {key!r} must be bytes, got {type(value).__name__}")
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _ints(meta: dict, key: str) -> tuple[int, ...]:
    value = meta.get(key)
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise FrameError(f"frame field {key!r} must be a list of non-negative integers")
    return tuple(value)


def _nixl_layout(meta: dict) -> tuple[tuple[int, int, int], ...]:
    value = meta.get("nixl_layout", [])
    if not isinstance(value, list) or not all(
        isinstance(entry, list) and len(entry) == 3 and all(_is_int(v) for v in entry)
        for entry in value
    ):
        raise FrameError(
            "handshake field 'nixl_layout' must be a list of [address, layer_stride, row_bytes]"
        )
    return tuple((a, s, r) for a, s, r in value)


def _first_block(fields: dict) -> int:
    """The handshake's first block sent (absent: 0), short of the sequence's last block."""
    if "first_block" not in fields:
        return 0
    first = _int(fields, "first_block")
    blocks = -(-_int(fields, "num_tokens", minimum=1) // _int(fields, "block_size", minimum=1))
    if first >= blocks:
        raise FrameError(
            f"handshake field 'first_block' {first} leaves none of the sequence's {blocks} "
            "blocks to send"
        )
    return first


def _heads(meta: dict, fingerprint: dict) -> tuple[int, int] | None:
    value = meta.get("heads")
    if value is None:
        return None
    total = fingerprint.get("num_kv_heads")
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        or not isinstance(total, int)
        or not 0 <= value[0] < value[1] <= total
    ):
        raise FrameError(
            f"handshake field 'heads' must be [start, stop) within the model's {total} KV "
            f"heads, got {value!r}"
        )
    return value[0], value[1]


def decode_frame(meta: bytes, payload: bytes | Landed, crc: int) -> Frame:
    """Verify and parse one frame. Raises FrameError (checksum, metadata, types, ranges)."""
    if len(meta) > MAX_META_BYTES:
        raise FrameError(f"frame metadata is {len(meta)} bytes (limit {MAX_META_BYTES})")
    landed = isinstance(payload, Landed)
    if (checksum_parts(meta, payload.parts) if landed else checksum(meta, payload)) != crc:
        if not landed and zlib.crc32(payload, zlib.crc32(meta)) == crc:
            raise HandshakeError(
                f"the peer speaks KV transfer protocol version 1 (zlib CRC-32 checksums); this "
                f"side speaks {PROTOCOL_VERSION} (CRC32C): run the same pdcluster version on "
                "both sides"
            )
        raise FrameError("frame checksum mismatch (corrupted frame)")
    try:
        fields = msgpack.unpackb(meta, raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several unrelated types for garbage
        raise FrameError(f"frame metadata is not valid msgpack: {err}") from None
    if not isinstance(fields, dict):
        raise FrameError("frame metadata must be a msgpack map")
    kind = fields.get("type")
    layer_count = _int(fields, "layer_count", minimum=1) if "layer_count" in fields else 1
    if kind == KV:
        return KVFrame(
            layer=_int(fields, "layer"),
            block_start=_int(fields, "block_start"),
            block_count=_int(fields, "block_count", minimum=1),
            payload=payload,
            layer_count=layer_count,
        )
    if landed:  # only a kv frame is written in place (peek_kv)
        raise FrameError(f"a {kind!r} frame carries no payload, got {payload.nbytes} bytes")
    if payload:
        raise FrameError(f"a {kind!r} frame carries no payload, got {len(payload)} bytes")
    if kind == READY:
        ready = ReadyFrame(
            layer=_int(fields, "layer"),
            block_start=_int(fields, "block_start"),
            block_count=_int(fields, "block_count", minimum=1),
            seq=_int(fields, "seq"),
            source_blocks=_ints(fields, "source_blocks"),
            nbytes=_int(fields, "nbytes", minimum=1),
            data_crc=_int(fields, "data_crc"),
            layer_count=layer_count,
        )
        if len(ready.source_blocks) != ready.block_count:
            raise FrameError(
                f"kv_ready frame names {len(ready.source_blocks)} source blocks for "
                f"{ready.block_count} blocks"
            )
        return ready
    if kind == HANDSHAKE:
        fingerprint = fields.get("fingerprint")
        if not isinstance(fingerprint, dict):
            raise FrameError("handshake field 'fingerprint' must be a map")
        return Handshake(
            request_id=_str(fields, "request_id"),
            lease_id=_str(fields, "lease_id"),
            fingerprint=fingerprint,
            block_size=_int(fields, "block_size", minimum=1),
            num_tokens=_int(fields, "num_tokens", minimum=1),
            wire_dtype=_str(fields, "wire_dtype"),
            payload_dtype=_str(fields, "payload_dtype"),
            layout=_str(fields, "layout"),
            version=_int(fields, "version"),
            data_channel=_bool(fields, "data_channel"),
            nixl_agent=_bytes(fields, "nixl_agent"),
            nixl_layout=_nixl_layout(fields),
            nixl_blocks=_int(fields, "nixl_blocks") if "nixl_blocks" in fields else 0,
            heads=_heads(fields, fingerprint),
            first_block=_first_block(fields),
        )
    if kind == END:
        forks = fields.get("fork_tokens", [])
        if not isinstance(forks, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in forks
        ):
            raise FrameError("end frame field 'fork_tokens' must be a list of token ids")
        return EndFrame(
            first_token=_int(fields, "first_token") if "first_token" in fields else None,
            num_kv_frames=_int(fields, "num_kv_frames"),
            fork_tokens=tuple(forks),
        )
    if kind == DATA_ANSWER:
        return DataAnswer(connected=_bool(fields, "connected"))
    raise FrameError(f"unknown frame type {kind!r}")


def peek_kv(meta: bytes) -> tuple[int, int, int, int] | None:
    """(layer, block_start, block_count, layer_count) of a kv frame's metadata, read before
    its checksum is known (to place the payload); None for anything else, which then goes
    the checked way (decode_frame refuses it with its reason)."""
    try:
        fields = msgpack.unpackb(meta, raw=False, strict_map_key=True)
    except Exception:
        return None
    if not isinstance(fields, dict) or fields.get("type") != KV:
        return None
    values = [fields.get(k) for k in ("layer", "block_start", "block_count")]
    values.append(fields.get("layer_count", 1))
    if not all(_is_int(v) for v in values) or min(values[2:]) < 1:
        return None
    return tuple(values)


def fingerprint_diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The fields in which two model fingerprints differ, sorted."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def check_version(handshake: Handshake) -> None:
    if handshake.version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"protocol version {handshake.version} is not supported (this side speaks "
            f"{PROTOCOL_VERSION})"
        )


def check_compatible(
    handshake: Handshake, *, fingerprint: dict[str, Any], block_size: int, cache_is_fp8: bool
) -> None:
    """Refuse (HandshakeError) a stream the receiver cannot store exactly as promised."""
    check_version(handshake)
    ours = normalise_fingerprint(fingerprint)
    if handshake.fingerprint != ours:
        diff = fingerprint_diff(ours, handshake.fingerprint)
        raise HandshakeError(
            f"model fingerprint mismatch in {diff}: sender {handshake.fingerprint}, receiver {ours}"
        )
    if handshake.block_size != block_size:
        raise HandshakeError(
            f"block size mismatch: sender {handshake.block_size}, receiver {block_size}"
        )
    if handshake.layout != LAYOUT:
        raise HandshakeError(f"layout {handshake.layout!r} is not supported (expected {LAYOUT!r})")
    if handshake.wire_dtype not in WIRE_DTYPES:
        raise HandshakeError(
            f"wire dtype {handshake.wire_dtype!r} is not supported (choose {WIRE_DTYPES})"
        )
    if handshake.payload_dtype not in PAYLOAD_DTYPES:
        raise HandshakeError(f"payload dtype {handshake.payload_dtype!r} is not supported")
    is_fp8_payload = handshake.payload_dtype == "float8_e4m3fn"
    if (handshake.wire_dtype == "fp8") != is_fp8_payload:
        raise HandshakeError(
            f"wire dtype {handshake.wire_dtype!r} does not match payload dtype "
            f"{handshake.payload_dtype!r}"
        )
    if cache_is_fp8 and not is_fp8_payload:
        raise HandshakeError(
            "the receiver's cache is fp8: send with wire dtype 'fp8' (passthrough would need "
            "requantisation on the receiver)"
        )
