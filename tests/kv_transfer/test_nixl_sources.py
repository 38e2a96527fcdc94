"""The NIXL transport's two halves of an abort, and the in-place reads they guard: the send
side keeps the prefill blocks it named held until every READ of them ended (or the drain
passed), and the receive side's READ stops when its transfer is cancelled instead of waiting
out its deadline on a sender that stopped. Also: READ descriptors pair runs of both caches."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kv_transfer.errors import KVTransferError
from kv_transfer.nixl_agent import nixl_unavailable
from tests.kv_transfer.helpers import make_cache


class FakeAgent:
    """What the send side's ReadTracker uses of a NixlAgent, with notifications the test
    hands in."""

    def __init__(self) -> None:
        self.held = 0
        self.lingered = 0.0
        self.notes: list[bytes] = []

    def hold(self) -> None:
        self.held += 1

    def unhold(self, count: int = 1) -> None:
        self.held -= count

    def linger(self, seconds: float) -> None:
        self.lingered = seconds

    def notifications(self) -> list[bytes]:
        notes, self.notes = self.notes, []
        return notes


class FakeStream:
    """The gRPC stream under a NIXL stream: records the frames it was given."""

    class handshake:  # noqa: N801 - stands for a Handshake
        lease_id = "lease"
        num_blocks = 4

    def __init__(self, refuse: bool = False) -> None:
        self.frames = []
        self.refuse = refuse
        self.aborted = False

    def check_blocks(self, first_block: int, count: int) -> None:
        assert first_block + count <= self.handshake.num_blocks

    def send_ready(self, layer: int, first_block: int, source_blocks, data) -> None:
        from kv_transfer import frames

        seq = len(self.frames)
        self.frames.append(frames.encode_ready(layer, first_block, seq, source_blocks, data))

    def seal_ready_frames(self) -> int:
        return len(self.frames)

    def finish(self, first_token, fork_tokens=()):
        if self.refuse:
            raise KVTransferError("refused", "DATA_LOSS")
        return "result"

    def abort(self, reason: str) -> None:
        self.aborted = True


def _stream(refuse: bool = False):
    from kv_transfer.nixl_transport import NixlSendStream, ReadTracker

    agent = FakeAgent()
    stream = NixlSendStream(make_cache(torch.bfloat16), ReadTracker(agent), FakeStream(refuse))
    freed = []
    stream.on_sources_free(lambda: freed.append(time.monotonic()))
    return stream, agent, freed


def _wait(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_a_finished_streams_sources_are_free_at_once():
    stream, agent, freed = _stream()
    stream.send_layer(0, torch.tensor([3, 1]), 0)
    assert agent.held == 1 and not freed  # a receiver may READ them now
    assert stream.finish(7) == "result"
    assert len(freed) == 1 and agent.held == 0


def test_an_aborted_streams_sources_stay_held_until_every_read_ended():
    stream, agent, freed = _stream()
    stream.send_layer(0, torch.tensor([3, 1]), 0)
    stream.send_layer(1, torch.tensor([3, 1]), 0)
    stream.abort("client went away")
    assert agent.lingered > 0 and not freed  # its READs may still be under way
    agent.notes.append(b"lease:0")
    agent.notes.append(b"other:1")  # another stream's: counts for nothing here
    time.sleep(0.05)
    assert not freed
    agent.notes.append(b"lease:1")  # ... and now the last one has ended
    _wait(lambda: freed)
    stream.abort("twice is fine")
    assert len(freed) == 1 and agent.held == 0


def test_an_aborted_streams_sources_come_back_after_the_drain(monkeypatch):
    from kv_transfer import nixl_transport

    monkeypatch.setattr(nixl_transport, "ABORT_DRAIN_S", 0.1)
    stream, _, freed = _stream()
    stream.send_layer(0, torch.tensor([2]), 0)
    started = time.monotonic()
    stream.abort("gone")
    _wait(lambda: freed)  # no notification: the drain's end frees them
    assert freed[0] - started >= 0.1


def test_a_refused_finish_drains_too_and_a_stream_that_sent_nothing_frees_at_once():
    stream, agent, freed = _stream(refuse=True)
    stream.send_layer(0, torch.tensor([0]), 0)
    with pytest.raises(KVTransferError):
        stream.finish(1)
    assert not freed
    agent.notes.append(b"lease:0")
    _wait(lambda: freed)
    idle, _, idle_freed = _stream()
    idle.abort("never sent")
    assert idle_freed  # nothing of it was ever read


def test_kv_ready_frames_name_the_source_blocks_and_checksum_them_in_order():
    import crc32c

    from kv_transfer import frames

    stream, _, _ = _stream()
    stream.send_layer(2, torch.tensor([5, 6, 1]), 1)
    meta, payload, crc = stream._stream.frames[0]
    frame = frames.decode_frame(meta, payload, crc)
    assert (frame.layer, frame.block_start, frame.seq) == (2, 1, 0)
    assert frame.source_blocks == (5, 6, 1)
    cache = stream._cache.tensors()
    expected = 0
    for tensor in cache:
        rows = tensor[2].reshape(tensor.shape[1], -1).view(torch.uint8).numpy()
        expected = crc32c.crc32c(rows[[5, 6, 1]].tobytes(), expected)
    assert frame.data_crc == expected
    assert frame.nbytes == 3 * sum(t.stride(1) * t.element_size() for t in cache)


def test_read_descriptors_pair_the_runs_both_caches_share():
    from kv_transfer.nixl_transport import paired_runs

    source = np.array([4, 5, 6, 9, 10, 2])
    dest = np.array([0, 1, 7, 8, 9, 10])
    starts, lengths = paired_runs(source, dest)
    # [4,5]->[0,1]; 6->7 (dest jumps); [9,10]->[8,9] (source jumps); 2->10
    assert starts.tolist() == [0, 2, 3, 5] and lengths.tolist() == [2, 1, 2, 1]
    starts, lengths = paired_runs(np.array([3]), np.array([8]))
    assert starts.tolist() == [0] and lengths.tolist() == [1]


@pytest.mark.skipif(nixl_unavailable() is not None, reason=str(nixl_unavailable()))
def test_a_cancelled_read_returns_promptly_and_lands_nothing_after():
    from kv_transfer.nixl_agent import NixlAgent

    source, target = NixlAgent("prefill"), NixlAgent("decode")
    try:
        remote = torch.arange(32 << 20, dtype=torch.uint8)  # 32 MiB of the sender's memory
        local = torch.zeros_like(remote)
        source.register(remote)
        target.register(local)
        peer = target.add_peer(source.metadata())
        # The source holds nothing, so nothing progresses it: over UCX's TCP transport the
        # READ cannot move, and only the cancellation ends it before its deadline.
        region = lambda t: [(t.data_ptr(), t.numel())]  # noqa: E731
        cancel_at = time.monotonic() + 0.2
        start = time.monotonic()
        try:
            target.read(
                peer,
                region(local),
                region(remote),
                b"gone:0",
                deadline=start + 30.0,
                cancelled=lambda: time.monotonic() > cancel_at,
            )
        except KVTransferError as error:
            assert error.code == "CANCELLED"
        assert time.monotonic() - start < 6.0  # not the 30 s deadline
        after = local.clone()
        source.hold()  # the source progresses again: a READ not really ended would go on
        time.sleep(0.3)
        assert np.array_equal(local.numpy(), after.numpy())
    finally:
        source.close()
        target.close()


@pytest.mark.skipif(nixl_unavailable() is not None, reason=str(nixl_unavailable()))
def test_a_block_that_differs_from_its_checksum_is_refused_and_its_lease_released():
    import threading

    from engine.block_manager import BlockManager
    from kv_transfer import transport
    from kv_transfer.lease import LeaseTable
    from kv_transfer.options import KVTransferOptions
    from tests.kv_transfer.helpers import BLOCK_SIZE, FINGERPRINT, MODEL, TOKEN

    options = KVTransferOptions(transport="nixl", token=TOKEN)
    lock = threading.RLock()
    leases = LeaseTable(BlockManager(16, BLOCK_SIZE), lock, default_timeout_s=10.0)
    recv = transport("nixl").recv_side(FINGERPRINT, options)
    recv.start(make_cache(torch.bfloat16), leases)
    send = transport("nixl").send_side(make_cache(torch.bfloat16), FINGERPRINT, options)
    try:
        lease = leases.reserve("bad-crc", 2 * BLOCK_SIZE)
        stream = send.open(recv.handle_for(lease), "bad-crc", 2 * BLOCK_SIZE)
        inner = stream._stream.send_ready

        def flip_one_layer(layer, first_block, source_blocks, data):
            if layer == 1:  # as if a byte of this layer changed on the way
                data = [bytes(sum(memoryview(d).nbytes for d in data))]  # the right size
            inner(layer, first_block, source_blocks, data)

        stream._stream.send_ready = flip_one_layer
        for layer in range(MODEL.num_layers):
            stream.send_layer(layer, torch.tensor([4, 2]), 0)
        with pytest.raises(KVTransferError, match="corrupted"):
            stream.finish(first_token=1)
        assert lease.state == "released" and leases.active() == 0
        assert recv.stats().transfers_failed == 1
    finally:
        send.close()
        recv.stop()


@pytest.mark.skipif(nixl_unavailable() is not None, reason=str(nixl_unavailable()))
def test_layers_ready_together_are_one_read_and_land_exactly():
    """A backlog of layers (the drain thread busy) goes as one kv_ready frame of several
    layers, one READ; every layer's blocks land in the lease exactly."""
    import threading

    from engine.block_manager import BlockManager
    from kv_transfer import transport
    from kv_transfer.lease import LeaseTable
    from kv_transfer.options import KVTransferOptions
    from kv_transfer.sender import _Piece
    from tests.kv_transfer.helpers import BLOCK_SIZE, FINGERPRINT, MODEL, TOKEN, equal_bytes

    options = KVTransferOptions(transport="nixl", token=TOKEN)
    leases = LeaseTable(BlockManager(16, BLOCK_SIZE), threading.RLock(), default_timeout_s=10.0)
    recv_cache, send_cache = make_cache(torch.bfloat16), make_cache(torch.bfloat16)
    recv = transport("nixl").recv_side(FINGERPRINT, options)
    recv.start(recv_cache, leases)
    send = transport("nixl").send_side(send_cache, FINGERPRINT, options)
    try:
        lease = leases.reserve("merged", 2 * BLOCK_SIZE)
        stream = send.open(recv.handle_for(lease), "merged", 2 * BLOCK_SIZE)
        inner, gate, taken = stream._stream._next_item, threading.Event(), []

        def gated_next_item():  # the drain thread waits once it took layer 0
            item = inner()
            if isinstance(item, tuple) and isinstance(item[1], _Piece):
                taken.append(item)
                gate.wait(10)
            return item

        stream._stream._next_item = gated_next_item
        for layer in range(MODEL.num_layers):
            stream.send_layer(layer, torch.tensor([4, 2]), 0)
            if layer == 0:
                _wait(lambda: len(taken) == 1)
        gate.set()
        result = stream.finish(first_token=1)
        assert result.num_frames == 3  # handshake, one kv_ready of every layer, end
        assert lease.state == "complete"
        for got, sent in ((recv_cache.k, send_cache.k), (recv_cache.v, send_cache.v)):
            assert equal_bytes(got[:, lease.block_ids], sent[:, [4, 2]])
    finally:
        send.close()
        recv.stop()
