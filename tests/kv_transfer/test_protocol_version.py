"""Protocol version 2 (CRC32C checksums): a peer on version 1 (zlib CRC-32) is recognised and
refused with a message that says so, before any block is touched; a corrupted byte is a
checksum error."""

from __future__ import annotations

import zlib

import grpc
import msgpack
import pytest

from kv_transfer import frames
from kv_transfer.errors import FrameError, HandshakeError
from tests.kv_transfer.helpers import BLOCK_SIZE, handshake, pb, push_raw, start_receiver


def _v1_frame(meta: dict) -> tuple[bytes, bytes, int]:
    """A frame as a version-1 sender encoded it: zlib CRC-32."""
    packed = msgpack.packb(meta, use_bin_type=True)
    return packed, b"", zlib.crc32(b"", zlib.crc32(packed))


def test_the_checksum_is_crc32c():
    meta, payload, crc = frames.encode_kv(0, 0, 1, b"\x01\x02\x03")
    import crc32c

    assert crc == crc32c.crc32c(meta + payload) != zlib.crc32(meta + payload)


def test_a_version_1_frame_is_named_as_such():
    meta, payload, crc = _v1_frame({"type": "end", "first_token": 1, "num_kv_frames": 0})
    with pytest.raises(HandshakeError, match="version 1"):
        frames.decode_frame(meta, payload, crc)


def test_a_corrupted_byte_is_a_checksum_error():
    meta, payload, crc = frames.encode_kv(0, 0, 1, bytes(range(64)))
    bad = bytearray(payload)
    bad[17] ^= 0x10
    with pytest.raises(FrameError, match="checksum"):
        frames.decode_frame(meta, bytes(bad), crc)


@pytest.mark.parametrize("how", ["zlib checksums", "version field 1"])
def test_a_version_1_sender_is_refused_with_a_message_before_it_touches_a_lease(how):
    receiver = start_receiver()
    try:
        lease = receiver.leases.reserve("old", 2 * BLOCK_SIZE)
        meta = handshake(lease, version=1).to_meta()
        if how == "zlib checksums":
            frame = _v1_frame(meta)
        else:  # a version-2 encoding claiming version 1
            frame = frames.encode_frame(meta)
        code, details = push_raw(receiver.address, [pb(frame)])
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "version 1" in details and f"{frames.PROTOCOL_VERSION}" in details
        assert lease.state == "reserved"  # never attached: the lease waits for a good sender
        assert receiver.free_blocks() == receiver.cache.num_blocks - 2
    finally:
        receiver.server.stop(0)
