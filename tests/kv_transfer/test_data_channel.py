"""The hot path of the KV transfer: the hand-written protobuf encoding of ``Frame`` and the
TCP data channel negotiated over the gRPC stream (auth, checksums, refusals, fallbacks)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer import KVSender, frames, wire
from kv_transfer.codec import FP8, encode_layer, layer_chunk_parts
from kv_transfer.receiver import grpc_options
from kv_transfer.sender import PUSH_METHOD
from protos import kv_transfer_pb2
from tests.kv_transfer.helpers import (
    BLOCK_SIZE,
    FINGERPRINT,
    MODEL,
    TOKEN,
    equal_bytes,
    handshake,
    layer_frames,
    pb,
    push_raw,
    random_blocks,
    snapshot,
    start_receiver,
)

L = MODEL.num_layers

# ---- the Frame encoding ----------------------------------------------------------------------


@settings(max_examples=200)
@given(
    meta=st.binary(max_size=300),
    parts=st.lists(st.binary(max_size=200), max_size=4),
    crc=st.integers(0, 2**32 - 1),
)
def test_wire_encoding_is_a_protobuf_frame(meta, parts, crc):
    data = wire.serialize_wire((meta, parts, crc))
    message = kv_transfer_pb2.Frame.FromString(data)
    assert (message.meta, message.payload, message.crc32) == (meta, b"".join(parts), crc)
    if crc:  # proto3 leaves a zero crc out; otherwise the bytes are protobuf's own
        assert data == message.SerializeToString()
    prefixed = b"".join(wire.wire_parts(meta, parts, crc, length_prefix=True))
    assert prefixed == struct.pack("<I", len(data)) + data
    parsed = wire.parse_wire(message.SerializeToString())
    assert parsed.error is None
    assert (bytes(parsed.meta), bytes(parsed.payload), parsed.crc32) == (
        meta,
        b"".join(parts),
        crc,
    )


@settings(max_examples=300)
@given(data=st.binary(max_size=64))
def test_parse_wire_never_raises_and_agrees_with_protobuf(data):
    parsed = wire.parse_wire(data)
    if parsed.error is not None:
        assert "malformed" in parsed.error
        return
    message = kv_transfer_pb2.Frame.FromString(data)  # what we accept, protobuf accepts
    assert (bytes(parsed.meta), bytes(parsed.payload), parsed.crc32) == (
        message.meta,
        message.payload,
        message.crc32,
    )


def test_parse_wire_skips_unknown_fields_and_takes_the_last_value():
    data = (
        b"\x0a\x01a"  # meta = "a"
        + b"\x20\x96\x01"  # field 4, varint (unknown)
        + b"\x0a\x02bc"  # meta = "bc" (last wins)
        + b"\x1d\x01\x00\x00\x00"
    )
    parsed = wire.parse_wire(data)
    assert parsed.error is None and bytes(parsed.meta) == b"bc" and parsed.crc32 == 1
    assert wire.parse_wire(b"\x12\x05ab").error  # runs past the end


# ---- the data channel ------------------------------------------------------------------------


@pytest.fixture
def receiver():
    r = start_receiver(torch.bfloat16, data_channel=True)
    yield r
    r.server.stop(0)


def _layers(n, seed=0):
    ks, vs = zip(*(random_blocks(n, torch.bfloat16, seed=seed + i) for i in range(L)), strict=True)
    return torch.stack(ks), torch.stack(vs)


def _send(address, lease, k, v, **kw):
    kw.setdefault("data_channel", True)
    kw.setdefault("data_channel_min_bytes", 0)
    with KVSender(address, TOKEN, **kw) as sender:
        stream = sender.open(
            lease.request_id,
            lease.lease_id,
            FINGERPRINT,
            BLOCK_SIZE,
            lease.num_tokens,
            L,
            "passthrough",
            k.dtype,
        )
        for layer in range(L):
            stream.send_layer(layer, k[layer], v[layer])
        result = stream.finish(first_token=3)
    return stream, result


@pytest.mark.parametrize(
    "sender_wants, receiver_offers", [(True, True), (False, True), (True, False)]
)
def test_round_trip_with_and_without_the_data_channel(sender_wants, receiver_offers):
    r = start_receiver(torch.bfloat16, data_channel=True)
    if not receiver_offers:
        r.server.stop(0)
        r.server.data_channel = False
        r.server.start()
    try:
        lease = r.leases.reserve("req-d", 3 * BLOCK_SIZE + 5)
        k, v = _layers(4)
        stream, result = _send(
            r.address, lease, k, v, data_channel=sender_wants, max_frame_bytes=4096
        )
        used = sender_wants and receiver_offers
        assert stream.used_data_channel == used
        assert r.server.stats.data_channel_transfers == int(used)
        assert lease.state == "complete" and lease.first_token == 3
        assert equal_bytes(r.cache.k[:, lease.block_ids], k)
        assert equal_bytes(r.cache.v[:, lease.block_ids], v)
        assert r.server.stats.bytes_received == result.payload_bytes
    finally:
        r.server.stop(0)


@pytest.mark.parametrize(
    "cache_dtype, source_dtype, wire_dtype, lands",
    [
        (torch.bfloat16, torch.bfloat16, "passthrough", True),
        (FP8, FP8, "fp8", True),  # pages and scales as they are
        (torch.bfloat16, torch.float32, "passthrough", False),  # cast on the way in
    ],
)
def test_kv_payloads_land_in_the_lease_blocks_as_they_arrive(
    cache_dtype, source_dtype, wire_dtype, lands
):
    """Where the cache keeps the payload's bytes as they are, the data channel's reader
    receives each kv payload straight into the lease's blocks (no buffer, no copy after);
    elsewhere the frame is buffered, decoded and copied. Same bytes either way."""
    r = start_receiver(cache_dtype, data_channel=True)
    copies = []
    scatter = r.cache.scatter
    r.cache.scatter = lambda *a: copies.append(a[0]) or scatter(*a)
    try:
        lease = r.leases.reserve("req-land", 3 * BLOCK_SIZE + 5)
        others = [b for b in range(r.cache.num_blocks) if b not in set(lease.block_ids)]
        before = snapshot(r.cache)
        k, v = _layers(4)
        k, v = k.to(source_dtype), v.to(source_dtype)
        heads = MODEL.num_kv_heads
        scales = [torch.rand(L, 4, heads) + 0.1, torch.rand(L, 4, heads) + 0.1]
        with KVSender(r.address, TOKEN, data_channel=True, max_frame_bytes=4096) as sender:
            stream = sender.open(
                "req-land", lease.lease_id, FINGERPRINT, BLOCK_SIZE, lease.num_tokens, L,
                wire_dtype, source_dtype,
            )  # fmt: skip
            for layer in range(L):
                pages = (scales[0][layer], scales[1][layer]) if wire_dtype == "fp8" else ()
                stream.send_layer(layer, k[layer], v[layer], *pages)
            stream.finish(first_token=3)
        assert stream.used_data_channel and stream.num_frames > 3 + L  # several per layer
        assert lease.state == "complete"
        assert (copies == []) == lands
        ids = lease.block_ids
        assert equal_bytes(r.cache.k[:, ids], k.to(cache_dtype))
        assert equal_bytes(r.cache.v[:, ids], v.to(cache_dtype))
        if r.cache.is_fp8:
            assert torch.equal(r.cache.k_scale[:, ids], scales[0])
            assert torch.equal(r.cache.v_scale[:, ids], scales[1])
        for old, new in zip(before, snapshot(r.cache), strict=True):
            assert equal_bytes(old[:, others], new[:, others])
    finally:
        r.server.stop(0)


def test_a_frame_for_a_lease_that_ended_lands_nowhere(receiver):
    """The lease is released (expired, say) while its sender is on the data channel: the
    frames that come after it write nothing, in its blocks (back in the pool) or others."""
    lease = receiver.leases.reserve("req-gone", 2 * BLOCK_SIZE)
    before = snapshot(receiver.cache)
    k, v = _layers(2, seed=7)
    good = [f for layer in range(L) for f in _kv_wire(layer, k[layer], v[layer])]

    def data():
        receiver.leases.release(lease.lease_id, "test: expired")
        time.sleep(0.2)
        yield from good

    code, _ = push_over_data_channel(receiver.address, lease, data())
    assert code != grpc.StatusCode.OK
    for old, new in zip(before, snapshot(receiver.cache), strict=True):
        assert equal_bytes(old, new)
    assert receiver.free_blocks() == receiver.cache.num_blocks


def test_payload_span_finds_the_payload_of_frames_laid_out_as_sent():
    meta, parts, crc = frames.encode_kv_parts(2, 0, 1, [b"x" * 300])
    data = b"".join(wire.wire_parts(meta, parts, crc))
    tag, start, length = wire.payload_span(memoryview(data)[:256])
    assert data[:tag] == b"\x0a" + bytes([len(meta)]) + meta
    assert (length, data[start : start + length]) == (300, b"x" * 300)
    assert frames.peek_kv(meta) == (2, 0, 1, 1)
    crc_first = b"\x1d" + data[-4:] + data[:-5]  # valid protobuf, another layout
    assert wire.payload_span(memoryview(crc_first)) is None
    assert wire.payload_span(memoryview(data)[: len(meta) + 2]) is None  # too short to tell
    for other in (frames.encode_end(1, 2)[0], b"\x80", msgpack.packb({"type": "kv"})):
        assert frames.peek_kv(other) is None


def test_a_data_port_out_of_reach_falls_back_to_grpc_and_is_not_asked_again(receiver):
    """The receiver offers its data channel but the sender cannot connect (a firewall): the
    transfer completes over gRPC, and the sender's next streams do not ask for a while."""
    k, v = _layers(2)
    with KVSender(receiver.address, TOKEN, data_channel=True, data_channel_min_bytes=0) as sender:
        tries = []

        def unreachable(port, ticket, timeout_s):
            tries.append(timeout_s)
            raise ConnectionRefusedError("port closed")

        sender.connect_data = unreachable
        for i in range(2):
            lease = receiver.leases.reserve(f"req-fw{i}", 2 * BLOCK_SIZE)
            stream = sender.open(
                lease.request_id, lease.lease_id, FINGERPRINT, BLOCK_SIZE, 32, L,
                "passthrough", k.dtype,
            )  # fmt: skip
            assert stream.handshake.data_channel == (i == 0)
            for layer in range(L):
                stream.send_layer(layer, k[layer], v[layer])
            stream.finish(first_token=3)
            assert lease.state == "complete" and not stream.used_data_channel
            assert equal_bytes(receiver.cache.k[:, lease.block_ids], k)
            assert equal_bytes(receiver.cache.v[:, lease.block_ids], v)
        assert len(tries) == 1 and 0 < tries[0] <= 2.0 and not sender.wants_data_channel()
    assert receiver.server.stats.data_channel_transfers == 0


def test_an_offer_must_be_answered_before_any_kv_frame(receiver):
    lease = receiver.leases.reserve("req-na", 2 * BLOCK_SIZE)
    k, v = _layers(2)
    hs = pb(frames.encode_handshake(handshake(lease, data_channel=True)))
    kv = layer_frames(0, k[0], v[0])
    code, details = push_raw(receiver.address, [hs, *kv])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "answer" in details
    assert lease.state == "released"
    declined = pb(frames.encode_data_answer(False))  # then the same frames over gRPC do
    lease = receiver.leases.reserve("req-na2", 2 * BLOCK_SIZE)
    hs = pb(frames.encode_handshake(handshake(lease, data_channel=True)))
    layers = [f for layer in range(L) for f in layer_frames(layer, k[layer], v[layer])]
    end = pb(frames.encode_end(1, len(layers)))
    assert push_raw(receiver.address, [hs, declined, *layers, end]) == (grpc.StatusCode.OK, "")
    assert lease.state == "complete" and equal_bytes(receiver.cache.k[:, lease.block_ids], k)
    stray = pb(frames.encode_data_answer(True))  # an answer nobody asked for
    lease = receiver.leases.reserve("req-na3", 2 * BLOCK_SIZE)
    hs = pb(frames.encode_handshake(handshake(lease)))
    code, details = push_raw(receiver.address, [hs, stray, *layers, end])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "no offer" in details


def test_send_layer_copies_unless_told_not_to(receiver):
    """By default the caller may overwrite its tensors as soon as send_layer returns."""
    lease = receiver.leases.reserve("req-copy", 2 * BLOCK_SIZE)
    k, v = _layers(2)
    sent_k, sent_v = k.clone(), v.clone()
    with KVSender(receiver.address, TOKEN, max_frame_bytes=2048) as sender:
        stream = sender.open(
            "req-copy", lease.lease_id, FINGERPRINT, BLOCK_SIZE, 32, L, "passthrough", k.dtype
        )
        for layer in range(L):
            stream.send_layer(layer, k[layer], v[layer])
            k[layer].zero_()
            v[layer].zero_()
        stream.finish(0)
    assert equal_bytes(receiver.cache.k[:, lease.block_ids], sent_k)
    assert equal_bytes(receiver.cache.v[:, lease.block_ids], sent_v)


def _data_connect(receiver, token: str, ticket: str) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", receiver.server.data_port), timeout=5)
    conn.sendall(wire.data_preamble(token, ticket))
    return conn


@pytest.mark.parametrize("token, ticket", [("wrong-token", None), (TOKEN, "no-such-ticket")])
def test_data_connection_without_token_or_ticket_is_refused(receiver, token, ticket):
    lease = receiver.leases.reserve("req-t", 16)
    before = snapshot(receiver.cache)
    if ticket is None:  # a real, outstanding ticket: the token alone must stop the peer
        ticket, _slot = receiver.server._data.expect()
    with _data_connect(receiver, token, ticket) as conn:
        reply = conn.recv(200)
        assert reply.startswith(b"refused")
        assert conn.recv(10) == b""  # closed
    assert lease.state == "reserved"
    for old, new in zip(before, snapshot(receiver.cache), strict=True):
        assert equal_bytes(old, new)


def _kv_wire(layer, k, v, blocks_per_frame=1000, corrupt=False):
    encoded = encode_layer(k, v, wire_dtype="passthrough", num_tokens=k.shape[0] * BLOCK_SIZE)
    out = []
    for start, count, parts in layer_chunk_parts(encoded, blocks_per_frame):
        meta, parts, crc = frames.encode_kv_parts(layer, start, count, parts)
        out.append(b"".join(wire.wire_parts(meta, parts, crc ^ corrupt, length_prefix=True)))
    return out


def push_over_data_channel(address, lease, data: list[bytes], *, end=True, finish=True):
    """Handshake over gRPC asking for the data channel, ``data`` (raw bytes) over it, then
    (``finish``) a zero length and (``end``) the end frame. Returns (status, details)."""
    channel = grpc.insecure_channel(address, options=grpc_options())
    push = channel.stream_unary(PUSH_METHOD, request_serializer=wire.serialize_wire)
    call = []
    started = threading.Event()  # gRPC may pull the next message before future() returns

    def messages():
        yield frames.encode_handshake(handshake(lease, data_channel=True))
        started.wait(10)
        metadata = dict(call[0].initial_metadata())
        conn = _data_connect_to(address, metadata)
        yield frames.encode_data_answer(True)
        with conn:
            try:
                for chunk in data:
                    conn.sendall(chunk)
                if finish:
                    conn.sendall(b"\0\0\0\0")
            except OSError:
                pass  # the receiver refused a frame and hung up: its status says why
        if end:
            yield frames.encode_end(1, L)

    try:
        call.append(push.future(messages(), metadata=(("authorization", f"Bearer {TOKEN}"),)))
        started.set()
        call[0].result(timeout=10)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        return err.code(), err.details()
    finally:
        channel.close()


def _data_connect_to(address, metadata):
    host = address.rsplit(":", 1)[0]
    conn = socket.create_connection((host, int(metadata["kv-data-port"])), timeout=5)
    conn.sendall(wire.data_preamble(TOKEN, metadata["kv-data-ticket"]))
    return conn


def _cases(k, v):
    good = [f for layer in range(L) for f in _kv_wire(layer, k[layer], v[layer])]
    bad_crc = _kv_wire(0, k[0], v[0], corrupt=True)
    flipped = bytearray(good[0])
    flipped[len(flipped) // 2] ^= 0x10  # a payload byte, already in the lease's blocks
    return {
        "corrupted byte": ([bytes(flipped), *good[1:]], {}, "INVALID_ARGUMENT", "checksum"),
        "good": (good, {}, "OK", ""),
        "bad checksum": ([*bad_crc, *good[1:]], {}, "INVALID_ARGUMENT", "checksum"),
        "truncated": ([good[0][:100]], {"finish": False}, "INVALID_ARGUMENT", "truncated"),
        "too large": ([struct.pack("<I", 2**31)], {"finish": False}, "INVALID_ARGUMENT", "limit"),
        "malformed": ([struct.pack("<I", 3) + b"\x0a\x09a"], {}, "INVALID_ARGUMENT", "malformed"),
        "duplicate layer": ([*good, good[0]], {}, "INVALID_ARGUMENT", "duplicate layer"),
        "missing layer": (good[:-1], {}, "INVALID_ARGUMENT", "missing"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "good",
        "corrupted byte",
        "bad checksum",
        "truncated",
        "too large",
        "malformed",
        "duplicate layer",
        "missing layer",
    ],
)
def test_data_channel_frames_are_checked_like_grpc_frames(receiver, case):
    free = receiver.free_blocks()
    other = receiver.leases.reserve("bystander", 20)
    lease = receiver.leases.reserve("req-dc", 2 * BLOCK_SIZE)
    before = snapshot(receiver.cache)
    k, v = _layers(2)
    data, kw, status, fragment = _cases(k, v)[case]
    code, details = push_over_data_channel(receiver.address, lease, data, **kw)
    assert code == grpc.StatusCode[status], details
    assert fragment in details, details
    mine = set(lease.block_ids)
    others = [b for b in range(receiver.cache.num_blocks) if b not in mine]
    for old, new in zip(before, snapshot(receiver.cache), strict=True):
        assert equal_bytes(old[:, others], new[:, others])
    assert other.state == "reserved"
    if case == "good":
        assert lease.state == "complete"
        assert equal_bytes(receiver.cache.k[:, lease.block_ids], k)
        with receiver.lock:
            receiver.blocks.free(list(lease.block_ids))
    else:
        assert lease.state == "released"
    receiver.leases.release(other.lease_id, "test over")
    assert receiver.free_blocks() == free and receiver.leases.active() == 0


def test_sender_that_never_connects_is_timed_out(receiver, monkeypatch):
    """A sender that asks for the data channel and never connects loses its lease."""
    monkeypatch.setattr("kv_transfer.receiver.DATA_CONNECT_TIMEOUT_S", 0.3)
    lease = receiver.leases.reserve("req-n", 16)
    channel = grpc.insecure_channel(receiver.address, options=grpc_options())
    push = channel.stream_unary(PUSH_METHOD, request_serializer=wire.serialize_wire)
    hs = frames.encode_handshake(handshake(lease, data_channel=True))
    connected = frames.encode_data_answer(True)  # it says so, and does not
    future = push.future(iter([hs, connected]), metadata=(("authorization", f"Bearer {TOKEN}"),))
    with pytest.raises(grpc.RpcError) as err:
        future.result(timeout=10)
    channel.close()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "data connection" in err.value.details()
    assert lease.state == "released"
    assert receiver.free_blocks() == receiver.cache.num_blocks
