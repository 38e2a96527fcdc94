"""LeaseTable: reservation, release, expiry and completion hand the blocks to the right owner."""

from __future__ import annotations

import threading

import pytest

from engine.block_manager import BlockManager
from kv_transfer.errors import LeaseError, LeaseExpiredError, LeaseStateError
from kv_transfer.lease import LeaseTable, NoCapacityError


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _table(num_blocks=8, **kw):
    blocks = BlockManager(num_blocks, 16)
    clock = FakeClock()
    table = LeaseTable(blocks, threading.RLock(), default_timeout_s=5.0, clock=clock, **kw)
    return table, blocks, clock


def test_reserve_takes_ceil_blocks_and_release_returns_them():
    table, blocks, _ = _table()
    lease = table.reserve("r1", 33)
    assert len(lease.block_ids) == 3 and lease.state == "reserved"
    assert blocks.num_free_blocks == 5 and table.active() == 1
    assert table.get(lease.lease_id) is lease
    assert table.release(lease.lease_id, "test")
    assert not table.release(lease.lease_id, "again")  # idempotent
    assert blocks.num_free_blocks == 8 and table.active() == 0
    with pytest.raises(LeaseError, match="released"):
        table.get(lease.lease_id)
    with pytest.raises(LeaseError, match="unknown"):
        table.get("nope")


def test_no_capacity():
    table, blocks, _ = _table(num_blocks=2)
    with pytest.raises(NoCapacityError):
        table.reserve("r1", 33)
    assert blocks.num_free_blocks == 2


def test_expire_releases_only_late_unfinished_leases():
    table, blocks, clock = _table()
    a = table.reserve("a", 16, timeout_s=1.0)
    b = table.reserve("b", 16, timeout_s=10.0)
    c = table.reserve("c", 16, timeout_s=1.0)
    table.begin(c.lease_id, "c")
    table.complete(c, first_token=5)
    clock.now += 2.0
    assert table.expire() == [a.lease_id]
    assert blocks.num_free_blocks == 8 - 2  # b still reserved, c now owned by the caller
    with pytest.raises(LeaseError, match="expired"):
        table.get(a.lease_id)
    assert table.get(c.lease_id).first_token == 5
    assert not table.release(c.lease_id, "too late")
    clock.now += 20.0
    with pytest.raises(LeaseError, match="expired"):  # get releases a late lease on the spot
        table.get(b.lease_id)
    assert blocks.num_free_blocks == 7


def test_begin_checks_request_and_state_and_write_checks_ownership():
    done = []
    table, blocks, clock = _table(on_complete=done.append)
    lease = table.reserve("r", 20)
    with pytest.raises(LeaseStateError, match="belongs to request"):
        table.begin(lease.lease_id, "other")
    table.begin(lease.lease_id, "r")
    with pytest.raises(LeaseStateError, match="receiving"):
        table.begin(lease.lease_id, "r")
    assert table.write(lease, lambda x: x + 1, 1) == 2
    table.release(lease.lease_id, "aborted")
    with pytest.raises(LeaseExpiredError):
        table.write(lease, lambda: pytest.fail("written after release"))
    late = table.reserve("r2", 20, timeout_s=1.0)
    table.begin(late.lease_id, "r2")
    clock.now += 1.5
    with pytest.raises(LeaseExpiredError):
        table.complete(late, 3)
    assert done == [] and blocks.num_free_blocks == 8


def test_writes_take_no_engine_lock_and_a_release_waits_for_a_copy_in_flight():
    """The engine loop holds its lock for whole steps: a frame's copy must not wait for it.
    A lease released (expired, aborted) while a copy is in flight gives its blocks back only
    when that copy has ended, and no copy starts after the release."""
    table, blocks, clock = _table()
    lease = table.reserve("r", 32)
    table.begin(lease.lease_id, "r")
    with table.engine_lock:  # the loop is in a long step...
        copied = threading.Event()
        writer = threading.Thread(target=lambda: table.write(lease, copied.set))
        writer.start()
        assert copied.wait(2.0)  # ...and the copy went ahead anyway
        writer.join()
    in_copy, finish = threading.Event(), threading.Event()

    def slow_copy():
        in_copy.set()
        assert finish.wait(2.0)

    writer = threading.Thread(target=lambda: table.write(lease, slow_copy))
    writer.start()
    assert in_copy.wait(2.0)
    clock.now += 10.0
    assert table.expire() == [lease.lease_id]  # released while the copy is in flight
    assert blocks.num_free_blocks == 8 - 2  # ...but the blocks are not back yet
    with pytest.raises(LeaseExpiredError, match="released during the transfer"):
        table.write(lease, lambda: pytest.fail("a copy started after the release"))
    finish.set()
    writer.join()
    assert blocks.num_free_blocks == 8  # the copy ended: now they are


def test_the_owner_hears_of_every_release_once_with_its_reason():
    released = []
    table, blocks, clock = _table(
        on_release=lambda lease: released.append(
            (lease.request_id, lease.release_reason, blocks.num_free_blocks)
        )
    )
    refused = table.reserve("refused", 16)
    stalled = table.reserve("stalled", 16)
    done = table.reserve("done", 16)
    table.begin(done.lease_id, "done")
    table.complete(done, first_token=1)
    table.release(refused.lease_id, "refused: bad frame")
    table.release(refused.lease_id, "again")  # idempotent: no second call
    clock.now += 10
    assert table.expire() == [stalled.lease_id]
    table.release(done.lease_id, "late")  # complete: not released, nobody told
    # told after its block went back (of 8: "done" keeps its own, now its owner's)
    assert released == [("refused", "refused: bad frame", 6), ("stalled", "expired", 7)]
