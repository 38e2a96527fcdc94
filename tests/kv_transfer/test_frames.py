"""Frame format: round trips, checksums, strict metadata, handshake compatibility, fuzzing."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer import frames
from kv_transfer.errors import FrameError, HandshakeError, KVTransferError
from tests.kv_transfer.helpers import BLOCK_SIZE, FINGERPRINT


def _hs(**kw) -> frames.Handshake:
    fields = dict(
        request_id="r",
        lease_id="l",
        fingerprint=frames.normalise_fingerprint(FINGERPRINT),
        block_size=BLOCK_SIZE,
        num_tokens=40,
        wire_dtype="fp8",
        payload_dtype="float8_e4m3fn",
    )
    fields.update(kw)
    return frames.Handshake(**fields)


def test_round_trip_of_each_frame_type():
    hs = _hs()
    assert frames.decode_frame(*frames.encode_handshake(hs)) == hs
    assert hs.num_blocks == 3
    kv = frames.decode_frame(*frames.encode_kv(2, 4, 3, b"abc"))
    assert kv == frames.KVFrame(2, 4, 3, b"abc") and kv.layers == range(2, 3)
    several = frames.decode_frame(*frames.encode_kv(2, 4, 3, b"abcdef", layer_count=2))
    assert several == frames.KVFrame(2, 4, 3, b"abcdef", 2) and several.layers == range(2, 4)
    assert frames.decode_frame(*frames.encode_end(17, 9)) == frames.EndFrame(17, 9)
    forked = frames.decode_frame(*frames.encode_end(17, 9, [4, 5]))
    assert forked == frames.EndFrame(17, 9, (4, 5))
    nixl = _hs(nixl_agent=b"agent", nixl_layout=((4096, 512, 64), (8192, 512, 64)), nixl_blocks=8)
    assert frames.decode_frame(*frames.encode_handshake(nixl)) == nixl
    ready = frames.decode_frame(*frames.encode_ready(1, 2, 0, [7, 3], [b"ab", b"cd"]))
    assert (ready.layer, ready.block_start, ready.block_count, ready.seq) == (1, 2, 2, 0)
    assert ready.source_blocks == (7, 3) and ready.nbytes == 4 and ready.layer_count == 1
    ready = frames.decode_frame(*frames.encode_ready(1, 2, 3, [7, 3], [b"ab", b"cd"], 2))
    assert (ready.layers, ready.seq, ready.nbytes) == (range(1, 3), 3, 4)


def test_checksum_covers_meta_and_payload():
    meta, payload, crc = frames.encode_kv(0, 0, 1, b"payload")
    with pytest.raises(FrameError, match="checksum"):
        frames.decode_frame(meta, b"paylaod", crc)
    with pytest.raises(FrameError, match="checksum"):
        frames.decode_frame(meta[:-1] + b"\x02", payload, crc)


@pytest.mark.parametrize(
    "meta",
    [
        {"type": "kv", "layer": -1, "block_start": 0, "block_count": 1},
        {"type": "kv", "layer": True, "block_start": 0, "block_count": 1},
        {"type": "kv", "layer": 0, "block_start": 0, "block_count": 0},
        {"type": "kv", "layer": "0", "block_start": 0, "block_count": 1},
        {"type": "kv", "layer": 0, "block_start": 0, "block_count": 1, "layer_count": 0},
        {"type": "end"},
        {"type": "end", "first_token": 1, "num_kv_frames": 2, "fork_tokens": [1, -2]},
        {"type": "end", "first_token": 1, "num_kv_frames": 2, "fork_tokens": 3},
        {"type": "nope"},
        {
            "type": "kv_ready",
            "layer": 0,
            "block_start": 0,
            "block_count": 2,
            "seq": 0,
            "source_blocks": [1],
            "nbytes": 8,
            "data_crc": 0,
        },  # fewer sources than blocks
        {
            "type": "kv_ready",
            "layer": 0,
            "block_start": 0,
            "block_count": 1,
            "seq": 0,
            "source_blocks": [-1],
            "nbytes": 8,
            "data_crc": 0,
        },
        {**_hs().to_meta(), "nixl_layout": [[1, 2]]},  # not [address, stride, row]
        [1, 2],
    ],
)
def test_bad_metadata_is_a_frame_error(meta):
    with pytest.raises(FrameError):
        frames.decode_frame(*frames.encode_frame(meta))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"fingerprint": {**FINGERPRINT, "num_layers": 99}}, "fingerprint"),
        ({"fingerprint": {**FINGERPRINT, "rope": {"theta": 1.0}}}, "fingerprint"),
        ({"block_size": 32}, "block size"),
        ({"layout": "heads-first"}, "layout"),
        ({"wire_dtype": "int4"}, "wire dtype"),
        ({"wire_dtype": "passthrough"}, "does not match"),
        ({"version": frames.PROTOCOL_VERSION + 1}, "protocol version"),
    ],
)
def test_handshake_mismatch_is_refused(change, match):
    hs = frames.decode_frame(*frames.encode_handshake(_hs(**change)))
    with pytest.raises(HandshakeError, match=match):
        frames.check_compatible(
            hs, fingerprint=FINGERPRINT, block_size=BLOCK_SIZE, cache_is_fp8=False
        )


def test_passthrough_into_fp8_cache_is_refused():
    hs = _hs(wire_dtype="passthrough", payload_dtype="bfloat16")
    with pytest.raises(HandshakeError, match="fp8"):
        frames.check_compatible(
            hs, fingerprint=FINGERPRINT, block_size=BLOCK_SIZE, cache_is_fp8=True
        )


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=12,
)
_metas = st.fixed_dictionaries(
    {"type": st.sampled_from(["handshake", "kv", "end", "x"])},
    optional={
        k: _values
        for k in (
            "layer",
            "block_start",
            "block_count",
            "first_token",
            "num_kv_frames",
            "request_id",
            "lease_id",
            "fingerprint",
            "block_size",
            "num_tokens",
            "version",
            "layout",
            "wire_dtype",
            "payload_dtype",
        )
    },
)


@settings(max_examples=300, deadline=None)
@given(meta=_metas, payload=st.binary(max_size=64))
def test_fuzzed_metadata_decodes_or_raises_frame_error(meta, payload):
    try:
        frame = frames.decode_frame(*frames.encode_frame(meta, payload))
    except FrameError:
        return
    assert isinstance(frame, frames.Handshake | frames.KVFrame | frames.EndFrame)


@settings(max_examples=300, deadline=None)
@given(meta=st.binary(max_size=96), payload=st.binary(max_size=32), crc=st.integers(0, 2**32 - 1))
def test_fuzzed_bytes_only_ever_raise_frame_errors(meta, payload, crc):
    for c in (crc, frames.checksum(meta, payload)):
        try:
            frames.decode_frame(meta, payload, c)
        except KVTransferError as err:
            assert isinstance(err, FrameError)


def test_oversized_metadata_is_refused():
    meta = msgpack.packb({"type": "end", "pad": "x" * (frames.MAX_META_BYTES + 1)})
    with pytest.raises(FrameError, match="limit"):
        frames.decode_frame(meta, b"", frames.checksum(meta, b""))
