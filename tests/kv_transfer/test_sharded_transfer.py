"""KV between tensor-parallel replicas, in one process: every prefill rank sends its own KV
heads to the decode rank(s) holding them over real gRPC receivers, rank 0's lease mirrored on
the other decode ranks (the rank channel replaced by direct calls). Exact bytes on every
rank, the lease complete only once all heads are in, and released leases drained on every
rank before their blocks are reused."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import ModelConfig
from engine.kv_cache import PagedKVCache
from engine.tensor_parallel import ShardLayout
from kv_transfer.errors import KVTransferError
from kv_transfer.grpc_transport import GrpcRecvSide, GrpcSendSide
from kv_transfer.lease import LeasePeers, LeaseTable
from kv_transfer.lease_mirror import CloseLease, MirrorLeaseTable, OpenLease, RankLeases
from kv_transfer.options import KVTransferOptions
from kv_transfer.sharding import KVLayout, RankReceiver, layout_problem, routes

MODEL = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=128,
    intermediate_size=128,
    num_layers=3,
    num_heads=8,
    num_kv_heads=4,
    head_dim=16,
    max_position_embeddings=512,
)
FINGERPRINT = MODEL.fingerprint()
BLOCK_SIZE = 16
NUM_BLOCKS = 12
OPTIONS = KVTransferOptions(token="sharded-test", lease_timeout_s=10.0, wire_dtype="passthrough")


def heads_of(tp: int) -> tuple[tuple[int, int], ...]:
    return ShardLayout(MODEL, tp).kv_heads_by_rank()


@pytest.mark.parametrize(
    "senders,receivers",
    [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (8, 1), (1, 8), (8, 2), (2, 8)],
)
def test_routes_give_every_receiver_head_once_from_its_first_holder(senders, receivers):
    sent, received = heads_of(senders), heads_of(receivers)
    plan = routes(sent, received)
    for r, (lo, hi) in enumerate(received):
        got = sorted(h for route in plan if route.receiver == r for h in range(*route.heads))
        assert got == list(range(lo, hi))
    for route in plan:
        holder = next(s for s, (a, b) in enumerate(sent) if a <= route.heads[0] < b)
        assert route.sender == holder  # replicated heads come from their lowest rank only
        assert sent[route.sender][0] <= route.heads[0] < route.heads[1] <= sent[route.sender][1]
    assert any(r.sender == 0 and r.receiver == 0 for r in plan)  # the first token's stream


def test_layout_problems_name_both_sides():
    info = {"fingerprint": FINGERPRINT, "block_size": 16, "kv_cache_dtype": "torch.float32"}
    prefill = KVLayout.from_info({**info, "name": "prefill-0"})
    decode = KVLayout.from_info(
        {**info, "name": "decode-0", "block_size": 32, "tensor_parallel": {"kv_heads": heads_of(2)}}
    )
    problem = layout_problem(prefill, decode, wire_dtype="passthrough", transport="grpc")
    assert "prefill-0 (tp 1" in problem and "decode-0 (tp 2" in problem
    assert "block sizes differ" in problem
    same = dataclasses.replace(decode, block_size=16)
    assert layout_problem(prefill, same, wire_dtype="passthrough", transport="grpc") is None
    nixl = layout_problem(prefill, same, wire_dtype="passthrough", transport="nixl")
    assert "'nixl' moves the KV of tp 1 replicas only" in nixl


class DirectPeers(LeasePeers):
    """The rank channel as direct calls (both directions)."""

    def __init__(self, mirrors: dict[int, MirrorLeaseTable]) -> None:
        self.ranks = tuple(mirrors)
        self.mirrors = mirrors
        self.closed: list[str] = []

    def open(self, lease) -> None:
        message = OpenLease(
            lease.lease_id, lease.request_id, tuple(lease.block_ids), lease.num_tokens, 10.0
        )
        for mirror in self.mirrors.values():
            mirror.adopt(message)

    def close(self, lease_id: str, reason: str) -> None:
        self.closed.append(lease_id)
        for mirror in self.mirrors.values():
            mirror.close(CloseLease(lease_id, reason))


def full_kv(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (MODEL.num_layers, NUM_BLOCKS, BLOCK_SIZE, MODEL.num_kv_heads, MODEL.head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def shard_cache(heads: tuple[int, int], source=None) -> PagedKVCache:
    local = dataclasses.replace(MODEL, num_kv_heads=heads[1] - heads[0])
    cache = PagedKVCache(local, NUM_BLOCKS, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    if source is not None:
        cache.k.copy_(source[0][:, :, :, heads[0] : heads[1]])
        cache.v.copy_(source[1][:, :, :, heads[0] : heads[1]])
    return cache


class DecodeReplica:
    """b decode ranks: rank 0's table owns the blocks, ranks 1..b-1 mirror it."""

    def __init__(self, tp: int) -> None:
        self.heads = heads_of(tp)
        self.lock = threading.RLock()
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.completed: list = []
        deliver = lambda rank: lambda m: RankLeases.deliver(self.leases, rank, m)  # noqa: E731
        self.mirrors = {r: MirrorLeaseTable(deliver(r)) for r in range(1, tp)}
        self.peers = DirectPeers(self.mirrors) if tp > 1 else None
        self.leases = LeaseTable(
            self.blocks, self.lock, 10.0, on_complete=self.completed.append, peers=self.peers
        )
        self.caches = [shard_cache(h) for h in self.heads]
        self.sides = []
        for rank in range(tp - 1, -1, -1):  # the peers first: rank 0's handles list them
            peers = tuple(s.info for s in reversed(self.sides)) if rank == 0 else ()
            side = GrpcRecvSide(FINGERPRINT, OPTIONS, self.heads[rank], peers)
            side.start(self.caches[rank], self.leases if rank == 0 else self.mirrors[rank])
            side.info = RankReceiver(side.server.address, side.server.kv_heads)
            self.sides.append(side)
        self.rank0 = self.sides[-1]

    def free_blocks(self) -> int:
        with self.lock:
            return self.blocks.num_free_blocks

    def stop(self) -> None:
        for side in self.sides:
            side.stop()


@pytest.mark.parametrize("together", [False, True], ids=["send_layer", "send_layers"])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1), (2, 4), (4, 2), (8, 1), (1, 8)])
def test_every_decode_rank_gets_exactly_its_heads(prefill_tp, decode_tp, together):
    decode = DecodeReplica(decode_tp)
    try:
        source = full_kv()
        num_tokens = 5 * BLOCK_SIZE - 3
        lease = decode.leases.reserve(f"req-{prefill_tp}-{decode_tp}", num_tokens)
        handle = decode.rank0.handle_for(lease)
        assert len(handle.receivers) == (decode_tp if decode_tp > 1 else 0)
        send_from_every_rank(prefill_tp, handle, source, num_tokens, lease.request_id, together)
        deadline = time.monotonic() + 10
        while not decode.completed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [c.lease_id for c in decode.completed] == [lease.lease_id]
        assert decode.completed[0].first_token == 5
        for rank, (lo, hi) in enumerate(decode.heads):
            cache = decode.caches[rank]
            for i, block in enumerate(decode.completed[0].block_ids):
                assert torch.equal(cache.k[:, block], source[0][:, i, :, lo:hi])
                assert torch.equal(cache.v[:, block], source[1][:, i, :, lo:hi])
        assert decode.leases.active() == 0
        assert all(m.active() == 0 for m in decode.mirrors.values())
    finally:
        decode.stop()


def send_from_every_rank(prefill_tp, handle, source, num_tokens, request_id, together=False):
    """Each prefill rank sends its heads of ``source``'s first blocks, every layer (one call
    for all of them where ``together``)."""
    senders = heads_of(prefill_tp)
    ids = torch.arange(-(-num_tokens // BLOCK_SIZE), dtype=torch.int64)
    for rank in range(prefill_tp):
        cache = shard_cache(senders[rank], source)
        side = GrpcSendSide(cache, FINGERPRINT, OPTIONS, rank, senders)
        stream = side.open(handle, request_id, num_tokens)
        if together:
            stream.send_layers(0, MODEL.num_layers, ids)
        else:
            for layer in range(MODEL.num_layers):
                stream.send_layer(layer, ids)
        stream.finish(5 if rank == 0 else None)
        side.close()


def test_a_lease_waits_for_every_rank_and_a_failed_rank_releases_it_everywhere():
    decode = DecodeReplica(2)
    try:
        source = full_kv()
        num_tokens = 3 * BLOCK_SIZE
        free = decode.free_blocks()
        lease = decode.leases.reserve("partial", num_tokens)
        handle = decode.rank0.handle_for(lease)
        senders = heads_of(1)
        side = GrpcSendSide(shard_cache(senders[0], source), FINGERPRINT, OPTIONS, 0, senders)
        stream = side.open(handle, "partial", num_tokens)
        ids = torch.arange(3, dtype=torch.int64)
        for layer in range(MODEL.num_layers - 1):  # rank 1's stream will end short
            stream.send_layer(layer, ids)
        parts = stream._parts
        # Rank 0's part ends whole; rank 1's part is cut off.
        parts[0].stream.send_layer(MODEL.num_layers - 1, *_blocks(shard_cache((0, 2), source)))
        parts[0].stream.finish(5)
        time.sleep(0.2)
        assert decode.completed == []  # rank 1's heads are missing
        with pytest.raises(KVTransferError):
            parts[1].stream.finish(None)  # "layers missing": rank 1 refuses, releases its copy
        deadline = time.monotonic() + 10
        while decode.free_blocks() != free and time.monotonic() < deadline:
            time.sleep(0.01)
        assert decode.free_blocks() == free  # released on rank 0, drained on rank 1
        assert decode.completed == []
        assert decode.peers.closed == [lease.lease_id]
        with pytest.raises(Exception, match="released"):
            decode.mirrors[1].get(lease.lease_id)
        side.close()
    finally:
        decode.stop()


def _blocks(cache: PagedKVCache):
    layer = MODEL.num_layers - 1
    return cache.k[layer, :3].clone(), cache.v[layer, :3].clone()


def test_a_released_lease_waits_for_a_peer_copy_in_flight():
    decode = DecodeReplica(2)
    try:
        mirror = decode.mirrors[1]
        free = decode.free_blocks()
        lease = decode.leases.reserve("slow", 2 * BLOCK_SIZE)
        copy = mirror.begin(lease.lease_id, "slow", (2, 4), (2, 4))
        started, finish = threading.Event(), threading.Event()

        def slow_copy():
            started.set()
            finish.wait(5)

        writer = threading.Thread(target=mirror.write, args=(copy, slow_copy))
        writer.start()
        started.wait(5)
        decode.leases.release(lease.lease_id, "cancelled")
        assert decode.free_blocks() < free  # rank 1 has a copy in flight
        finish.set()
        writer.join(5)
        assert decode.free_blocks() == free
        with pytest.raises(Exception, match="released"):
            mirror.write(copy, lambda: pytest.fail("written after release"))
    finally:
        decode.stop()


def test_a_stream_of_heads_a_rank_does_not_hold_is_refused_and_released():
    decode = DecodeReplica(2)
    try:
        free = decode.free_blocks()
        # Each receiver refuses the stream before it touches the lease (nothing is written),
        # so the lease goes at its expiry, on both ranks: a short one here (with the
        # table's 10 s and a 10 s wait below, this test raced the sweeper in CI).
        lease = decode.leases.reserve("misrouted", BLOCK_SIZE, timeout_s=2.0)
        handle = decode.rank0.handle_for(lease)
        first, second = handle.receivers
        swapped = dataclasses.replace(  # a handle whose ranks claim each other's heads
            handle,
            receivers=(
                RankReceiver(first.address, second.heads),
                RankReceiver(second.address, first.heads),
            ),
        )
        senders = heads_of(1)
        side = GrpcSendSide(shard_cache(senders[0], full_kv()), FINGERPRINT, OPTIONS, 0, senders)
        stream = side.open(swapped, "misrouted", BLOCK_SIZE)
        with pytest.raises(KVTransferError, match="this receiver holds heads"):
            for layer in range(MODEL.num_layers):
                stream.send_layer(layer, torch.arange(1, dtype=torch.int64))
            stream.finish(5)
        stream.abort("test over")
        side.close()
        deadline = time.monotonic() + 10
        while decode.free_blocks() != free and time.monotonic() < deadline:
            time.sleep(0.01)  # the expired lease released on both ranks
        assert decode.free_blocks() == free and decode.completed == []
    finally:
        decode.stop()
