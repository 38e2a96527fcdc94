"""The NIXL transport's two halves of an abort: the send side's staging slots drain before
reuse (a receiver's READ of them may be under way), and the receive side's READ stops when
its transfer is cancelled instead of waiting out its deadline on a sender that stopped."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kv_transfer.errors import KVTransferError
from kv_transfer.nixl_agent import nixl_unavailable


class FakeAgent:
    """What StagingPool uses of a NixlAgent, with notifications the test hands in."""

    def __init__(self) -> None:
        self.held = 0
        self.lingered = 0.0
        self.notes: list[bytes] = []

    def register(self, tensor) -> None:
        pass

    def hold(self) -> None:
        self.held += 1

    def unhold(self, count: int = 1) -> None:
        self.held -= count

    def linger(self, seconds: float) -> None:
        self.lingered = seconds

    def notifications(self) -> list[bytes]:
        notes, self.notes = self.notes, []
        return notes


def _pool(slots: int = 1):
    from kv_transfer.nixl_transport import StagingPool

    agent = FakeAgent()
    return StagingPool(agent, slot_bytes=64, slots=slots), agent


def _soon(seconds: float = 0.05) -> float:
    return time.monotonic() + seconds


def test_a_finished_transfers_slots_are_free_at_once():
    pool, agent = _pool()
    pool.acquire("a", _soon())
    pool.release_all("a")
    assert pool.acquire("b", _soon()) == 0
    assert agent.held == 1 and agent.lingered == 0.0


def test_an_aborted_transfers_slots_drain_before_reuse():
    from kv_transfer.nixl_transport import ABORT_DRAIN_S

    pool, agent = _pool()
    pool.acquire("a", _soon())
    pool.release_all("a", drain=True)
    assert agent.held == 0 and agent.lingered == ABORT_DRAIN_S  # still progressing
    with pytest.raises(KVTransferError, match="stayed full"):
        pool.acquire("b", _soon())  # its READ may still be under way
    agent.notes.append(b"a:0")  # ... and now it has ended
    assert pool.acquire("b", _soon()) == 0


def test_a_drained_slot_comes_back_after_the_drain(monkeypatch):
    from kv_transfer import nixl_transport

    monkeypatch.setattr(nixl_transport, "ABORT_DRAIN_S", 0.1)
    pool, _ = _pool()
    pool.acquire("a", _soon())
    pool.release_all("a", drain=True)
    assert pool.acquire("b", _soon(2.0)) == 0  # no notification: the drain's end frees it


def test_a_notification_frees_only_its_owners_slot():
    pool, agent = _pool(slots=2)
    assert pool.acquire("a", _soon()) == 0
    assert pool.acquire("b", _soon()) == 1
    agent.notes.append(b"stale:0")  # not slot 0's owner
    with pytest.raises(KVTransferError):
        pool.acquire("c", _soon())
    agent.notes.append(b"b:1")
    assert pool.acquire("c", _soon()) == 1


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
