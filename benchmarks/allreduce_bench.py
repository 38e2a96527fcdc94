"""The tensor-parallel ranks' all-reduce on CPU: gloo next to the shared-memory one the engine
uses (engine/shm_allreduce.py), same sizes, same run, 2 ranks of one thread each.

    python -m benchmarks.allreduce_bench [--ranks 2] [--calls 500]
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

import torch

from engine.tp_group import TPGroup

SIZES = [576, 576 * 16, 576 * 256]  # one decode token's hidden state, 16 tokens, 256 tokens
CPU = torch.device("cpu")


def _rounds(group: TPGroup, calls: int, use_gloo: bool) -> list[float]:
    seconds = []
    for size in SIZES:
        tensor = torch.ones(size)
        reduce = (lambda t: group._pg.allreduce([t]).wait()) if use_gloo else group.all_reduce
        for _ in range(20):
            reduce(tensor)
        started = time.perf_counter()
        for _ in range(calls):
            reduce(tensor)
        seconds.append((time.perf_counter() - started) / calls)
    return seconds


def _worker(meeting, rank: int, calls: int) -> None:
    torch.set_num_threads(1)
    group = TPGroup.join_as_worker(meeting, rank, CPU)
    for use_gloo in (True, False):
        _rounds(group, calls, use_gloo)
    group.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(1)
    context = multiprocessing.get_context("spawn")
    meeting, store, listener = TPGroup.rendezvous(args.ranks, CPU)
    workers = [
        context.Process(target=_worker, args=(meeting, rank, args.calls))
        for rank in range(1, args.ranks)
    ]
    for process in workers:
        process.start()
    group = TPGroup.join_as_driver(meeting, store, listener, CPU)
    gloo = _rounds(group, args.calls, use_gloo=True)
    shm = _rounds(group, args.calls, use_gloo=False)
    for process in workers:
        process.join()
    group.close()
    print(f"all-reduce, {args.ranks} ranks, one thread each, {args.calls} calls per size")
    print(f"{'floats':>8} {'gloo us':>9} {'shared memory us':>17} {'speed-up':>9}")
    for size, g, s in zip(SIZES, gloo, shm, strict=True):
        print(f"{size:>8} {g * 1e6:>9.1f} {s * 1e6:>17.1f} {g / s:>8.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
