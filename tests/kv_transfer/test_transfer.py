"""Sender → receiver over gRPC on 127.0.0.1: exact round trips, refusals that change nothing
and leak nothing, access control (token, TLS), leases freed when a transfer dies. What every
transport must do (abort, expiry, a dead sender) is in test_connector_contract.py."""

from __future__ import annotations

import datetime
import ipaddress
import threading
import time

import grpc
import pytest
import torch

from kv_transfer import KVSender, KVTransferError, frames
from kv_transfer.codec import FP8
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


@pytest.fixture
def receiver(request):
    dtype = getattr(request, "param", torch.bfloat16)
    r = start_receiver(dtype)
    yield r
    r.server.stop(0)


def _send(address, lease, k, v, *, wire="passthrough", num_tokens=None, scales=None, **kw):
    num_tokens = num_tokens or lease.num_tokens
    with KVSender(address, TOKEN, **kw) as sender:
        stream = sender.open(
            lease.request_id, lease.lease_id, FINGERPRINT, BLOCK_SIZE, num_tokens, L, wire, k.dtype
        )
        for layer in range(L):
            stream.send_layer(layer, k[layer], v[layer], *(scales or ()))
        return stream.finish(first_token=11)


def _layers(n, dtype, seed=0):
    ks, vs = zip(*(random_blocks(n, dtype, seed=seed + i) for i in range(L)), strict=True)
    return torch.stack(ks), torch.stack(vs)


def _others_unchanged(receiver, before, lease_blocks):
    """Every block outside ``lease_blocks`` holds exactly what it held before."""
    others = [b for b in range(receiver.cache.num_blocks) if b not in set(lease_blocks)]
    for old, new in zip(before, snapshot(receiver.cache), strict=True):
        assert equal_bytes(old[:, others], new[:, others])


@pytest.mark.parametrize("receiver", [torch.float32, torch.float16, torch.bfloat16], indirect=True)
def test_passthrough_round_trip_is_bit_exact(receiver):
    dtype = receiver.cache.dtype
    free = receiver.free_blocks()
    done = []
    receiver.leases.on_complete = done.append
    lease = receiver.leases.reserve("req-1", 3 * BLOCK_SIZE + 1)  # 4 blocks, last one partial
    before = snapshot(receiver.cache)
    k, v = _layers(4, dtype)
    result = _send(receiver.address, lease, k, v, max_frame_bytes=4096)  # several frames/layer
    assert result.num_frames > 2 + L
    assert done == [lease] and lease.state == "complete" and lease.first_token == 11
    for layer in range(L):
        assert equal_bytes(receiver.cache.k[layer, lease.block_ids], k[layer])
        assert equal_bytes(receiver.cache.v[layer, lease.block_ids], v[layer])
    _others_unchanged(receiver, before, lease.block_ids)
    # The blocks are now the decode worker's; the table no longer counts or frees them.
    assert receiver.leases.active() == 0 and receiver.free_blocks() == free - 4
    stats = receiver.server.stats
    assert stats.transfers_completed == 1 and stats.bytes_received == result.payload_bytes


@pytest.mark.parametrize("receiver", [torch.bfloat16, FP8], indirect=True)
def test_fp8_wire_round_trip(receiver):
    lease = receiver.leases.reserve("req-8", 2 * BLOCK_SIZE)
    k, v = _layers(2, torch.bfloat16)
    result = _send(receiver.address, lease, k, v, wire="fp8")
    assert result.payload_bytes < result.kv_bytes * 0.6
    cache = receiver.cache
    for layer in range(L):
        for src, dst, scale in (
            (k, cache.k, cache.k_scale),
            (v, cache.v, cache.v_scale),
        ):
            got = dst[layer, lease.block_ids].float()
            if cache.is_fp8:
                got = got * scale[layer, lease.block_ids][:, None, :, None]
            amax = src[layer].float().abs().amax(dim=(1, 3), keepdim=True)
            # half an e4m3 ulp at the top of the range, plus bf16 rounding of the result
            assert bool(((got - src[layer].float()).abs() <= amax * (2**-4 + 2**-8)).all())


@pytest.mark.parametrize("receiver", [FP8], indirect=True)
def test_fp8_pages_are_stored_as_they_are(receiver):
    lease = receiver.leases.reserve("req-p", 2 * BLOCK_SIZE)
    k, v = _layers(2, torch.float32)
    k, v = k.to(FP8), v.to(FP8)
    ks = torch.rand(L, 2, MODEL.num_kv_heads) + 0.1
    vs = torch.rand(L, 2, MODEL.num_kv_heads) + 0.1
    with KVSender(receiver.address, TOKEN) as sender:
        stream = sender.open("req-p", lease.lease_id, FINGERPRINT, BLOCK_SIZE, 32, L, "fp8", FP8)
        for layer in range(L):
            stream.send_layer(layer, k[layer], v[layer], ks[layer], vs[layer])
        stream.finish(1)
    cache = receiver.cache
    assert equal_bytes(cache.k[:, lease.block_ids], k)
    assert equal_bytes(cache.v[:, lease.block_ids], v)
    assert torch.equal(cache.k_scale[:, lease.block_ids], ks)
    assert torch.equal(cache.v_scale[:, lease.block_ids], vs)


# ---- refusals: status, cache unchanged, nothing leaked -------------------------------------


def _bad_streams(lease, k, v):
    """name → (frames, expected status, message fragment)."""
    hs = pb(frames.encode_handshake(handshake(lease)))
    layers = [f for layer in range(L) for f in layer_frames(layer, k[layer], v[layer])]
    end = pb(frames.encode_end(1, len(layers)))
    corrupt = pb(frames.encode_kv(0, 0, 2, bytes(layers[0].payload)))
    corrupt.crc32 ^= 1
    short = pb(frames.encode_kv(0, 0, 2, bytes(layers[0].payload)[:-2]))
    other = frames.encode_handshake(handshake(lease, lease_id="f" * 32))
    invalid = frames.encode_handshake(handshake(lease, fingerprint={**FINGERPRINT, "head_dim": 8}))
    return {
        "unknown lease": ([pb(other), *layers, end], "NOT_FOUND", "unknown lease"),
        "handshake mismatch": ([pb(invalid), *layers, end], "FAILED_PRECONDITION", "fingerprint"),
        "wrong request": (
            [pb(frames.encode_handshake(handshake(lease, request_id="someone-else")))],
            "FAILED_PRECONDITION",
            "belongs to request",
        ),
        "too many tokens": (
            [pb(frames.encode_handshake(handshake(lease, num_tokens=lease.num_tokens + 16)))],
            "INVALID_ARGUMENT",
            "lease",
        ),
        "no handshake": ([*layers, end], "INVALID_ARGUMENT", "handshake"),
        "duplicate layer": ([hs, *layers, layers[0], end], "INVALID_ARGUMENT", "duplicate layer"),
        "missing layer": ([hs, *layers[:-1], end], "INVALID_ARGUMENT", "missing"),
        "layer out of range": (
            [hs, pb(frames.encode_kv(L, 0, 2, bytes(layers[0].payload)))],
            "INVALID_ARGUMENT",
            "out of range",
        ),
        "blocks out of range": (
            [hs, pb(frames.encode_kv(0, 1, 2, bytes(layers[0].payload)))],
            "INVALID_ARGUMENT",
            "out of range",
        ),
        "wrong payload size": ([hs, short], "INVALID_ARGUMENT", "bytes"),
        "layers past the last": (
            [hs, pb(frames.encode_kv(L - 1, 0, 2, bytes(layers[0].payload) * 2, 2))],
            "INVALID_ARGUMENT",
            "out of range",
        ),
        "one layer's payload for two": (
            [hs, pb(frames.encode_kv(0, 0, 2, bytes(layers[0].payload), 2))],
            "INVALID_ARGUMENT",
            "payload of 2 layers",
        ),
        "bad checksum": ([hs, corrupt], "INVALID_ARGUMENT", "checksum"),
        "truncated": ([hs, *layers], "INVALID_ARGUMENT", "truncated"),
        "empty": ([], "INVALID_ARGUMENT", "empty"),
    }


BAD = [
    "unknown lease",
    "handshake mismatch",
    "wrong request",
    "too many tokens",
    "no handshake",
    "duplicate layer",
    "missing layer",
    "layer out of range",
    "blocks out of range",
    "wrong payload size",
    "layers past the last",
    "one layer's payload for two",
    "bad checksum",
    "truncated",
    "empty",
]


@pytest.mark.parametrize("case", BAD)
def test_bad_stream_is_refused_and_changes_nothing(receiver, case):
    free = receiver.free_blocks()
    other = receiver.leases.reserve("bystander", 20)  # another request's blocks: never touched
    lease = receiver.leases.reserve("req-bad", 2 * BLOCK_SIZE)
    before = snapshot(receiver.cache)
    k, v = _layers(2, torch.bfloat16)
    messages, status, fragment = _bad_streams(lease, k, v)[case]
    code, details = push_raw(receiver.address, messages)
    assert code == grpc.StatusCode[status], details
    assert fragment in details
    # Nothing outside the refused lease's own blocks was written.
    _others_unchanged(receiver, before, lease.block_ids)
    attached = case not in ("unknown lease", "wrong request", "no handshake", "empty")
    if attached:  # the refused transfer's lease went back to the pool at once
        assert lease.state == "released"
        assert receiver.free_blocks() == free - len(other.block_ids)
    else:
        assert lease.state == "reserved"
    assert other.state == "reserved"
    receiver.leases.release(lease.lease_id, "test over")
    receiver.leases.release(other.lease_id, "test over")
    assert receiver.free_blocks() == free
    # The receiver still serves a good transfer afterwards.
    good = receiver.leases.reserve("req-good", 2 * BLOCK_SIZE)
    _send(receiver.address, good, k, v)
    assert equal_bytes(receiver.cache.k[:, good.block_ids], k)


class _HeldCall:
    """A Push call whose transport takes nothing until ``result``: every layer is queued by
    then (a backlog), and the frames the stream sends are kept."""

    def __init__(self, frames_iterator) -> None:
        self._frames = frames_iterator
        self.sent = []

    def done(self) -> bool:
        return False

    def result(self, timeout=None):
        for meta, payload, crc in self._frames:
            joined = payload if isinstance(payload, bytes) else b"".join(bytes(p) for p in payload)
            self.sent.append((meta, joined, crc))


def test_layers_that_wait_together_go_as_one_frame(receiver):
    """A backlog of layers leaves as frames of several layers (each frame costs a fixed time),
    never larger than max_frame_bytes, and a receiver stores them exactly."""
    lease = receiver.leases.reserve("req-merged", 2 * BLOCK_SIZE)
    k, v = _layers(2, torch.bfloat16, seed=3)
    layer_bytes = 2 * k[0].numel() * k.element_size()
    sender = KVSender(
        "127.0.0.1:1", TOKEN, max_frames_in_flight=64, max_frame_bytes=2 * layer_bytes
    )
    calls = []

    def future(frames_iterator, **kw):
        calls.append(_HeldCall(frames_iterator))
        return calls[0]

    sender._stub = type("Stub", (), {"Push": type("M", (), {"future": staticmethod(future)})()})()
    stream = sender.open(
        "req-merged", lease.lease_id, FINGERPRINT, BLOCK_SIZE, 32, L, "passthrough", k.dtype
    )
    for layer in range(L):
        stream.send_layer(layer, k[layer], v[layer])
    stream.finish(first_token=5)
    sender.close()
    decoded = [frames.decode_frame(*f) for f in calls[0].sent]
    kv = [f for f in decoded if isinstance(f, frames.KVFrame)]
    assert L == 3 and [(f.layer, f.layer_count) for f in kv] == [(0, 2), (2, 1)]
    assert decoded[-1] == frames.EndFrame(5, len(kv)) and stream.num_frames == len(decoded)
    code, details = push_raw(receiver.address, [pb(f) for f in calls[0].sent])
    assert code == grpc.StatusCode.OK, details
    assert lease.state == "complete"
    assert equal_bytes(receiver.cache.k[:, lease.block_ids], k)
    assert equal_bytes(receiver.cache.v[:, lease.block_ids], v)


def test_expired_lease_is_refused(receiver):
    lease = receiver.leases.reserve("req-x", 16, timeout_s=0.05)
    time.sleep(0.2)
    k, v = _layers(1, torch.bfloat16)
    with pytest.raises(KVTransferError) as err:
        _send(receiver.address, lease, k, v)
    assert err.value.code in ("NOT_FOUND", "FAILED_PRECONDITION")
    assert "expired" in err.value.message or "released" in err.value.message
    assert receiver.leases.active() == 0 and receiver.free_blocks() == receiver.cache.num_blocks


def test_sender_sees_the_receivers_status(receiver):
    lease = receiver.leases.reserve("req-s", 16)
    k, v = _layers(1, torch.bfloat16)
    bad = {**FINGERPRINT, "num_kv_heads": MODEL.num_kv_heads}  # same shape, other architecture
    bad["architecture"] = "qwen2"
    with KVSender(receiver.address, TOKEN) as sender:
        stream = sender.open(
            "req-s", lease.lease_id, bad, BLOCK_SIZE, 16, L, "passthrough", k.dtype
        )
        with pytest.raises(KVTransferError) as err:
            for layer in range(L):
                stream.send_layer(layer, k[layer], v[layer])
            stream.finish(0)
    assert err.value.code == "FAILED_PRECONDITION" and "architecture" in err.value.message
    assert receiver.free_blocks() == receiver.cache.num_blocks


# ---- access ---------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_peer_without_the_token_is_refused(receiver, token):
    lease = receiver.leases.reserve("req-t", 16)
    before = snapshot(receiver.cache)
    k, v = _layers(1, torch.bfloat16)
    hs = pb(frames.encode_handshake(handshake(lease)))
    code, details = push_raw(receiver.address, [hs, *layer_frames(0, k[0], v[0])], token=token)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "token" in details
    assert lease.state == "reserved"  # an unauthenticated peer cannot even touch the lease
    _others_unchanged(receiver, before, [])


def _self_signed() -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def test_tls_transfer_and_plaintext_peer_refused():
    pytest.importorskip("cryptography")
    cert, key = _self_signed()
    r = start_receiver(torch.bfloat16, tls=(cert, key), data_channel=True)
    try:
        lease = r.leases.reserve("req-tls", 20)
        k, v = _layers(2, torch.bfloat16)
        _send(r.address, lease, k, v, tls_root_cert=cert, data_channel=True)
        assert equal_bytes(r.cache.k[:, lease.block_ids], k)
        assert r.server.stats.data_channel_transfers == 1  # the kv frames went over TLS too
        lease2 = r.leases.reserve("req-plain", 20)
        with pytest.raises(KVTransferError) as err:
            _send(r.address, lease2, k, v, timeout_s=2.0)
        assert err.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
        assert lease2.state == "reserved"
    finally:
        r.server.stop(0)


# ---- dying transfers ------------------------------------------------------------------------


def test_killed_channel_mid_stream_frees_blocks(receiver):
    lease = receiver.leases.reserve("req-c", 2 * BLOCK_SIZE)
    k, v = _layers(2, torch.bfloat16)
    sender = KVSender(receiver.address, TOKEN)
    stream = sender.open(
        "req-c", lease.lease_id, FINGERPRINT, BLOCK_SIZE, 32, L, "passthrough", k.dtype
    )
    stream.send_layer(0, k[0], v[0])
    _wait(lambda: lease.state == "receiving")
    sender.close()  # the connection goes away under the stream
    _wait(lambda: lease.state == "released")
    assert receiver.free_blocks() == receiver.cache.num_blocks


class _StalledCall:
    """A Push call whose transport never takes a frame (a stalled network or receiver)."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def done(self) -> bool:
        return self.cancelled.is_set()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True

    def result(self, timeout=None):
        raise grpc.FutureCancelledError()


def test_backpressure_bounds_frames_in_flight():
    """send_layer blocks once max_frames_in_flight frames wait, so a stalled transfer holds
    a bounded amount of memory; abort unblocks it."""
    k, v = _layers(8, torch.bfloat16)
    sender = KVSender("127.0.0.1:1", TOKEN, max_frames_in_flight=3, max_frame_bytes=2048)
    call = _StalledCall()
    sender._stub = type("Stub", (), {"Push": type("M", (), {"future": lambda *a, **kw: call})()})()
    stream = sender.open("r", "l", FINGERPRINT, BLOCK_SIZE, 128, L, "passthrough", k.dtype)
    errors = []

    def send():
        try:
            for layer in range(L):
                stream.send_layer(layer, k[layer], v[layer])
        except KVTransferError as err:
            errors.append(err)

    worker = threading.Thread(target=send)
    worker.start()
    time.sleep(0.3)
    # handshake + 2 frames queued, nothing sent, then blocked
    assert worker.is_alive() and stream._queue.qsize() == 3 and stream.num_frames == 0
    stream.abort("test")
    worker.join(2)
    assert not worker.is_alive() and errors and errors[0].code == "CANCELLED"
    sender.close()


def _wait(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_a_transfer_completes_while_the_engine_holds_its_lock(receiver):
    """The decode engine holds its lock for each whole step: the frames land anyway, and only
    the hand-off (on_complete, not used here) would wait for it."""
    lease = receiver.leases.reserve("req-busy", 3 * BLOCK_SIZE)
    k, v = _layers(3, receiver.cache.dtype, seed=5)
    held = threading.Event()
    release = threading.Event()

    def long_step():
        with receiver.lock:
            held.set()
            release.wait(20)

    stepping = threading.Thread(target=long_step)
    stepping.start()
    try:
        assert held.wait(5)
        started = time.monotonic()
        _send(receiver.address, lease, k, v, max_frame_bytes=4096)  # several frames per layer
        assert time.monotonic() - started < 5 and release.is_set() is False
        for layer in range(L):
            assert equal_bytes(receiver.cache.k[layer, lease.block_ids], k[layer])
            assert equal_bytes(receiver.cache.v[layer, lease.block_ids], v[layer])
    finally:
        release.set()
        stepping.join()
    assert lease.state == "complete"


def test_a_write_after_expiry_never_lands(receiver):
    """A sender that stalls past the lease's deadline: its later frames are refused and the
    blocks, back in the pool, keep what their next owner writes."""
    lease = receiver.leases.reserve("req-late", 2 * BLOCK_SIZE, timeout_s=0.3)
    k, v = _layers(2, receiver.cache.dtype, seed=6)
    with KVSender(receiver.address, TOKEN) as sender:
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
        stream.send_layer(0, k[0], v[0])
        time.sleep(0.8)  # past the deadline: the sweeper releases the lease
        assert receiver.leases.active() == 0
        before = snapshot(receiver.cache)
        with pytest.raises(KVTransferError):
            for layer in range(1, L):
                stream.send_layer(layer, k[layer], v[layer])
            stream.finish(first_token=3)
    for old, new in zip(before, snapshot(receiver.cache), strict=True):
        assert equal_bytes(old, new)  # nothing landed after the expiry
    assert receiver.free_blocks() == receiver.cache.num_blocks


@pytest.mark.parametrize(
    ("receiver", "wire"),
    [(torch.bfloat16, "passthrough"), (torch.bfloat16, "fp8"), (FP8, "fp8")],
    indirect=["receiver"],
)
@pytest.mark.parametrize("frame_layers", [1, 2, L])
def test_layers_sent_together_land_as_layers_sent_one_by_one(receiver, wire, frame_layers):
    """send_layers (one gather, one encode, frames of whole layers up to max_frame_bytes)
    leaves the same bytes in the receiver's cache as send_layer per layer, in fewer frames;
    a layer larger than a frame goes layer by layer."""
    num_tokens = 2 * BLOCK_SIZE + 3  # the last block partial: its stale rows ignored
    k, v = _layers(3, torch.bfloat16, seed=7)
    k[:, -1, 3:] = 1e4
    spec_bytes = 2 * 3 * (k[0, 0].numel() * (1 if wire == "fp8" else 2))
    layer_bytes = spec_bytes + (2 * 3 * MODEL.num_kv_heads * 4 if wire == "fp8" else 0)
    max_frame_bytes = frame_layers * layer_bytes if frame_layers < L else 4 << 20
    results, leases = [], []
    for together in (False, True):
        lease = receiver.leases.reserve(f"req-{together}", num_tokens)
        with KVSender(receiver.address, TOKEN, max_frame_bytes=max_frame_bytes) as sender:
            stream = sender.open(
                lease.request_id, lease.lease_id, FINGERPRINT, BLOCK_SIZE, num_tokens, L, wire,
                k.dtype,
            )  # fmt: skip
            if together:
                stream.send_layers(0, k, v)
            else:
                for layer in range(L):
                    stream.send_layer(layer, k[layer], v[layer])
            results.append(stream.finish(first_token=3))
        assert lease.state == "complete"
        leases.append(lease)
    one_by_one, together = results
    assert together.payload_bytes == one_by_one.payload_bytes
    assert together.num_frames == 2 + -(-L // frame_layers)  # handshake, kv frames, end
    assert one_by_one.num_frames >= together.num_frames
    cache = receiver.cache
    for tensors in (cache.tensors(), [cache.k_scale, cache.v_scale] if cache.is_fp8 else []):
        for t in tensors:
            assert equal_bytes(t[:, leases[0].block_ids], t[:, leases[1].block_ids])


def test_layers_too_large_for_a_frame_go_layer_by_layer(receiver):
    lease = receiver.leases.reserve("req-big", 4 * BLOCK_SIZE)
    k, v = _layers(4, torch.bfloat16, seed=9)
    block_bytes = 2 * k[0, 0].numel() * 2  # K and V of one block
    with KVSender(receiver.address, TOKEN, max_frame_bytes=2 * block_bytes) as sender:
        stream = sender.open(
            "req-big", lease.lease_id, FINGERPRINT, BLOCK_SIZE, 4 * BLOCK_SIZE, L, "passthrough",
            k.dtype,
        )  # fmt: skip
        stream.send_layers(0, k, v)
        result = stream.finish(first_token=1)
    assert result.num_frames == 2 + 2 * L  # two frames of two blocks per layer
    assert equal_bytes(receiver.cache.k[:, lease.block_ids], k)
    assert equal_bytes(receiver.cache.v[:, lease.block_ids], v)


def test_send_layers_refuses_no_layers_and_mismatched_shapes(receiver):
    lease = receiver.leases.reserve("req-none", BLOCK_SIZE)
    k, v = _layers(1, torch.bfloat16)
    with KVSender(receiver.address, TOKEN) as sender:
        stream = sender.open(
            "req-none", lease.lease_id, FINGERPRINT, BLOCK_SIZE, BLOCK_SIZE, L, "passthrough",
            k.dtype,
        )  # fmt: skip
        with pytest.raises(ValueError, match="at least one layer"):
            stream.send_layers(0, k[:0], v[:0])
        with pytest.raises(ValueError, match="must both be"):
            stream.send_layers(0, k, v[:, :, :8])
        stream.send_layers(0, k, v)  # the stream is still usable
        stream.finish(first_token=2)
    assert lease.state == "complete"
    assert equal_bytes(receiver.cache.k[:, lease.block_ids], k)
