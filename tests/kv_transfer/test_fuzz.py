"""Property-based fuzzing of frame sequences against a live receiver: whatever arrives, the
receiver answers with a clear status, never writes outside the lease's blocks, never leaks a
block, and keeps serving."""

from __future__ import annotations

import grpc
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_transfer import frames
from kv_transfer.codec import WireSpec
from tests.kv_transfer.helpers import (
    BLOCK_SIZE,
    MODEL,
    equal_bytes,
    handshake,
    pb,
    push_raw,
    snapshot,
    start_receiver,
)

L = MODEL.num_layers
N = 2  # blocks of the fuzzed request
SPEC = WireSpec(BLOCK_SIZE, MODEL.num_kv_heads, MODEL.head_dim, torch.bfloat16)
CLEAR = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
}

_kv = st.tuples(
    st.just("kv"),
    st.integers(0, L),  # layer (L is out of range)
    st.integers(0, N),  # block_start
    st.integers(1, N + 1),  # block_count
    st.integers(-3, 3),  # payload size error
    st.booleans(),  # corrupt checksum
    st.integers(0, 255),  # fill byte
)
_hs = st.tuples(
    st.just("hs"),
    st.sampled_from(["ok", "lease", "request", "tokens", "block_size", "fingerprint", "dtype"]),
)
_end = st.tuples(st.just("end"), st.integers(0, 10), st.booleans())
_raw = st.tuples(
    st.just("raw"), st.binary(max_size=40), st.binary(max_size=40), st.integers(0, 2**32 - 1)
)
_sequences = st.lists(st.one_of(_kv, _hs, _end, _raw), max_size=12)


def _build(op, lease, n_kv):
    kind = op[0]
    if kind == "hs":
        change = {
            "ok": {},
            "lease": {"lease_id": "0" * 32},
            "request": {"request_id": "other"},
            "tokens": {"num_tokens": lease.num_tokens + BLOCK_SIZE},
            "block_size": {"block_size": BLOCK_SIZE * 2},
            "fingerprint": {"fingerprint": {"architecture": "x"}},
            "dtype": {"payload_dtype": "float16"},
        }[op[1]]
        return pb(frames.encode_handshake(handshake(lease, **change)))
    if kind == "kv":
        _, layer, start, count, size_error, corrupt, fill = op
        size = max(0, SPEC.chunk_bytes(count) + size_error)
        message = pb(frames.encode_kv(layer, start, count, bytes([fill]) * size))
        if corrupt:
            message.crc32 ^= 0x5A5A
        return message
    if kind == "end":
        return pb(frames.encode_end(op[1], n_kv if op[2] else n_kv + 1))
    return pb((op[1], op[2], op[3]))


def test_fuzzed_frame_sequences_never_crash_or_corrupt_the_receiver():
    r = start_receiver(torch.bfloat16)
    free = r.free_blocks()

    @settings(
        max_examples=60,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(ops=_sequences, lead_with_handshake=st.booleans())
    def run(ops, lead_with_handshake):
        bystander = r.leases.reserve("bystander", 20)
        lease = r.leases.reserve("fuzz", N * BLOCK_SIZE)
        before = snapshot(r.cache)
        if lead_with_handshake:
            ops = [("hs", "ok"), *ops]
        n_kv = sum(1 for op in ops if op[0] == "kv")
        messages = [_build(op, lease, n_kv) for op in ops]
        code, details = push_raw(r.address, messages)
        assert code in CLEAR, (code, details)
        mine = set(lease.block_ids)
        others = [b for b in range(r.cache.num_blocks) if b not in mine]
        for old, new in zip(before, snapshot(r.cache), strict=True):
            assert equal_bytes(old[:, others], new[:, others])
        assert bystander.state == "reserved"
        if code == grpc.StatusCode.OK:
            assert lease.state == "complete"
            with r.lock:
                r.blocks.free(list(lease.block_ids))  # what the decode worker would do
        else:
            assert lease.state in ("released", "reserved")
            r.leases.release(lease.lease_id, "fuzz over")
        r.leases.release(bystander.lease_id, "fuzz over")
        assert r.free_blocks() == free and r.leases.active() == 0

    try:
        run()
    finally:
        r.server.stop(0)
