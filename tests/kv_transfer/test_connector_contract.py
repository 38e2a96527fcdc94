"""The KV connector's contract (kv_transfer/connector.py), run against every registered
transport (and the gRPC one with its data channel): exact bytes, bad streams refused with the
lease released, expiry, abort and a dead sender leaking nothing. Only the interface is used:
a transport that passes these can carry a cluster's KV."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine.block_manager import BlockManager
from kv_transfer import KVHandle, KVTransferError, transport, transport_names
from kv_transfer.lease import LeaseTable
from kv_transfer.nixl_agent import nixl_unavailable
from kv_transfer.options import KVTransferOptions
from tests.kv_transfer.helpers import (
    BLOCK_SIZE,
    FINGERPRINT,
    MODEL,
    TOKEN,
    equal_bytes,
    make_cache,
    snapshot,
)

VARIANTS = [(name, {}) for name in transport_names()] + [
    ("grpc", {"data_channel": True, "data_channel_min_bytes": 0})
]
IDS = [name + ("-data-channel" if extra else "") for name, extra in VARIANTS]
NUM_BLOCKS = 16
L = MODEL.num_layers


class Pair:
    """A receive side on a decode cache and a send side on a prefill cache, both live."""

    def __init__(self, name: str, extra: dict, dtype: torch.dtype, lease_timeout_s: float):
        wire = "fp8" if dtype == torch.float8_e4m3fn else "passthrough"  # fp8 pages as they are
        self.options = KVTransferOptions(transport=name, token=TOKEN, wire_dtype=wire, **extra)
        self.lock = threading.RLock()
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.leases = LeaseTable(self.blocks, self.lock, default_timeout_s=lease_timeout_s)
        self.decode_cache = make_cache(dtype, NUM_BLOCKS)
        self.prefill_cache = make_cache(dtype, NUM_BLOCKS)
        torch.manual_seed(5)
        for t in (self.prefill_cache.k, self.prefill_cache.v):  # differs from the decode cache
            t.copy_((torch.randn(t.shape) * 2).to(dtype))
        entry = transport(name)
        self.recv = entry.recv_side(FINGERPRINT, self.options)
        self.recv.start(self.decode_cache, self.leases)
        self.send = entry.send_side(self.prefill_cache, FINGERPRINT, self.options)

    def free_blocks(self) -> int:
        with self.lock:
            return self.blocks.num_free_blocks

    def wait_free(self, expected: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.free_blocks() != expected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.free_blocks() == expected

    def close(self) -> None:
        self.send.close()
        self.recv.stop()


@pytest.fixture(params=VARIANTS, ids=IDS)
def variant(request):
    name, _ = request.param
    if name == "nixl" and (why := nixl_unavailable()) is not None:
        pytest.skip(why)
    return request.param


def _pair(variant, dtype=torch.bfloat16, lease_timeout_s=10.0) -> Pair:
    return Pair(*variant, dtype, lease_timeout_s)


def _source_ids(n: int) -> torch.Tensor:
    return torch.tensor([9, 3, 4, 12, 0][:n], dtype=torch.int64)  # not in order, not a run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("together", [False, True], ids=["send_layer", "send_layers"])
def test_blocks_arrive_exactly_and_nothing_else_changes(variant, dtype, together):
    pair = _pair(variant, dtype)
    try:
        if dtype == torch.float8_e4m3fn:
            pair.prefill_cache.k_scale.uniform_(0.1, 4.0)
            pair.prefill_cache.v_scale.uniform_(0.1, 4.0)
        num_tokens = 2 * BLOCK_SIZE + 5  # two full blocks and a partial one
        lease = pair.leases.reserve("r1", num_tokens)
        handle = pair.recv.handle_for(lease)
        assert pickle.loads(pickle.dumps(handle)) == handle  # the router carries it as it is
        before = snapshot(pair.decode_cache)
        stream = pair.send.open(handle, "r1", num_tokens)
        src = _source_ids(3)
        if together:  # each chunk's layers at once, as a prefill step's last layers ship
            stream.send_layers(0, L, src[:2], 0)
            stream.send_layers(0, L, src[2:], 2)
        else:
            for layer in range(L):  # chunk by chunk, as a long prompt's chunks ship
                stream.send_layer(layer, src[:2], 0)
                stream.send_layer(layer, src[2:], 2)
        result = stream.finish(first_token=7, fork_tokens=(8, 9))
        done = pair.leases.get(lease.lease_id)
        assert (done.state, done.first_token, done.fork_tokens) == ("complete", 7, (8, 9))
        assert result.payload_bytes > 0 and result.lease_id == lease.lease_id
        after = snapshot(pair.decode_cache)
        dst = torch.tensor(lease.block_ids)
        source = snapshot(pair.prefill_cache)
        for got, was, sent in zip(after, before, source, strict=True):
            # [layers, blocks, ...]: the lease's blocks hold the sent ones, bit for bit
            assert equal_bytes(got[:, dst], sent[:, src])
            others = [b for b in range(NUM_BLOCKS) if b not in lease.block_ids]
            assert equal_bytes(got[:, others], was[:, others])
        assert pair.recv.stats().transfers_completed == 1
    finally:
        pair.close()


@pytest.mark.parametrize("fault", ["missing layer", "blocks out of order", "duplicate blocks"])
def test_a_bad_stream_is_refused_and_its_lease_released(variant, fault):
    pair = _pair(variant)
    try:
        free = pair.free_blocks()
        lease = pair.leases.reserve("bad", 2 * BLOCK_SIZE)
        stream = pair.send.open(pair.recv.handle_for(lease), "bad", 2 * BLOCK_SIZE)
        src = _source_ids(2)
        with pytest.raises(KVTransferError):
            for layer in range(L):
                if fault == "missing layer" and layer == 1:
                    continue
                if fault == "blocks out of order" and layer == 1:
                    stream.send_layer(layer, src[1:], 1)
                    stream.send_layer(layer, src[:1], 0)
                    continue
                stream.send_layer(layer, src, 0)
                if fault == "duplicate blocks" and layer == 1:
                    stream.send_layer(layer, src[1:], 1)
            stream.finish(first_token=1)
        pair.wait_free(free)
        assert pair.leases.active() == 0
        assert pair.recv.stats().transfers_failed == 1
    finally:
        pair.close()


def test_blocks_outside_the_sequence_are_refused_before_sending(variant):
    pair = _pair(variant)
    try:
        lease = pair.leases.reserve("range", BLOCK_SIZE)
        stream = pair.send.open(pair.recv.handle_for(lease), "range", BLOCK_SIZE)
        with pytest.raises((ValueError, KVTransferError)):
            stream.send_layer(0, _source_ids(2), 0)  # the sequence has one block
        stream.abort("test over")
    finally:
        pair.close()


def test_a_handle_of_another_transport_is_refused(variant):
    pair = _pair(variant)
    try:
        with pytest.raises(KVTransferError, match="transport"):
            pair.send.open(KVHandle("no-such-transport", "x", "nowhere"), "x", 4)
    finally:
        pair.close()


def test_nothing_lands_after_the_lease_expires(variant):
    pair = _pair(variant, lease_timeout_s=0.5)
    try:
        free = pair.free_blocks()
        lease = pair.leases.reserve("late", 2 * BLOCK_SIZE)
        stream = pair.send.open(pair.recv.handle_for(lease), "late", 2 * BLOCK_SIZE)
        src = _source_ids(2)
        stream.send_layer(0, src, 0)
        pair.wait_free(free)  # expired: the blocks are back in the pool
        expired = snapshot(pair.decode_cache)
        with pytest.raises(KVTransferError):
            for layer in range(1, L):
                stream.send_layer(layer, src, 0)
            stream.finish(first_token=1)
        time.sleep(0.2)
        for now, then in zip(snapshot(pair.decode_cache), expired, strict=True):
            assert equal_bytes(now, then)
    finally:
        pair.close()


def test_abort_releases_the_lease(variant):
    pair = _pair(variant)
    try:
        free = pair.free_blocks()
        lease = pair.leases.reserve("gone", 2 * BLOCK_SIZE)
        stream = pair.send.open(pair.recv.handle_for(lease), "gone", 2 * BLOCK_SIZE)
        stream.send_layer(0, _source_ids(2), 0)
        _wait_for(lambda: lease.state == "receiving")  # the receiver knows of the stream
        stream.abort("client went away")
        stream.abort("twice is fine")
        pair.wait_free(free, timeout_s=5.0)  # well before the 10 s deadline
        with pytest.raises(KVTransferError):
            stream.finish(first_token=1)
    finally:
        pair.close()


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


_DYING_SENDER = """
import os, sys, torch
from kv_transfer import KVHandle, transport
from kv_transfer.options import KVTransferOptions
from tests.kv_transfer.helpers import FINGERPRINT, TOKEN, make_cache
name, extra = sys.argv[1], sys.argv[2] == "1"
options = KVTransferOptions(transport=name, token=TOKEN, wire_dtype="passthrough",
                            data_channel=extra, data_channel_min_bytes=0)
send = transport(name).send_side(make_cache(torch.bfloat16), FINGERPRINT, options)
print("ready", flush=True)
handle_transport, lease_id, address = sys.stdin.readline().split()
stream = send.open(KVHandle(handle_transport, lease_id, address), "dying", 32)
stream.send_layer(0, torch.tensor([1, 2]), 0)
print("sent", flush=True)
os._exit(3)  # dies mid-transfer: no finish, no abort
"""


def test_a_sender_that_dies_mid_transfer_leaks_no_blocks(variant):
    name, extra = variant
    pair = _pair(variant, lease_timeout_s=3.0)
    child = subprocess.Popen(
        [sys.executable, "-c", _DYING_SENDER, name, "1" if extra.get("data_channel") else "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in child.stdout:  # NIXL logs to stdout too
            if line.strip() == "ready":
                break
        else:
            raise AssertionError(f"the sender did not start: {child.communicate()[1]}")
        free = pair.free_blocks()
        lease = pair.leases.reserve("dying", 2 * BLOCK_SIZE)
        handle = pair.recv.handle_for(lease)
        child.stdin.write(f"{handle.transport} {handle.lease_id} {handle.address}\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=120)
        assert child.returncode == 3 and "sent" in out, err
        pair.wait_free(free, timeout_s=10.0)  # the broken stream, or at worst the deadline
        assert pair.leases.active() == 0
        assert lease.state == "released"
    finally:
        child.kill()
        pair.close()
