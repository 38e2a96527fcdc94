"""The ranks' group on CPU: the shared-memory all-reduce gives every rank the same exact sum
(in pieces for what does not fit a slot), plans reach the workers, and a rank that never
arrives is an error after the timeout, not a hang."""

from __future__ import annotations

import multiprocessing
import os
import zlib

import pytest
import torch

from engine.errors import EngineError
from engine.shm_allreduce import SLOT_BYTES, ShmAllReduce
from engine.tp_group import TPGroup

CPU = torch.device("cpu")
SHAPES = [(1, 576), (37, 960), (SLOT_BYTES // 4 + 1,)]  # the last one: past a slot


def _values(rank: int, shape, dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(shape, generator=generator).to(dtype)


def _digest(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def _worker(meeting, rank: int, results) -> None:
    torch.set_num_threads(1)
    group = TPGroup.join_as_worker(meeting, rank, CPU)
    sums = []
    for _ in range(3):  # both buffers, then the first again
        for shape in SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                tensor = _values(rank, shape, dtype)
                sums.append(group.all_reduce(tensor).clone())
    results.put((rank, [_digest(s) for s in sums], group.receive()))
    group.close()


def test_every_rank_gets_the_same_exact_sum():
    size = 3
    context = multiprocessing.get_context("spawn")
    meeting, store, listener = TPGroup.rendezvous(size, CPU)
    results = context.Queue()
    workers = [context.Process(target=_worker, args=(meeting, r, results)) for r in (1, 2)]
    for process in workers:
        process.start()
    group = TPGroup.join_as_driver(meeting, store, listener, CPU)
    ours = []
    for _ in range(3):
        for shape in SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                tensor = _values(0, shape, dtype)
                expected = _values(0, shape, dtype) + _values(1, shape, dtype)
                expected += _values(2, shape, dtype)
                ours.append(group.all_reduce(tensor).clone())
                torch.testing.assert_close(ours[-1], expected, rtol=0, atol=0)
    group.send({"plan": [1, 2, 3]})
    replies = {}
    for _ in range(2):
        rank, sums, message = results.get(timeout=60)
        replies[rank] = (sums, message)
    for process in workers:
        process.join(timeout=30)
    group.close()
    for rank in (1, 2):
        sums, message = replies[rank]
        assert sums == [_digest(s) for s in ours]  # bit-identical on every rank
        assert message == {"plan": [1, 2, 3]}


def test_a_rank_that_never_arrives_is_an_error():
    path = ShmAllReduce.create(2)
    try:
        lone = ShmAllReduce(path, 0, 2, timeout_s=0.5)
        with pytest.raises(EngineError, match="did not arrive within"):
            lone.all_reduce(torch.ones(8))
        lone.close()
    finally:
        os.unlink(path)
