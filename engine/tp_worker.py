"""The ranks 1..t-1 of a tensor-parallel engine: processes that load their shard of the
model, then run every forward pass the driver (rank 0, the LLMEngine) sends them.

Lifecycle: ``start_workers`` (driver) meets the workers (engine.tp_group), loads its own
shard meanwhile, and waits for each worker's ``WorkerReady`` — or its ``WorkerFailed``, whose
message becomes the driver's error. Then each worker loops: a ``StepPlan`` is one forward
pass (its all-reduces meet the driver's), ``Stop`` ends it. A worker whose driver is gone
(EOF on its socket) exits; the driver sees a gone worker as a TensorParallelError at its
next step. The processes are daemons: they never outlive the driver's process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.tp_group import Rendezvous, TensorParallelError, TPGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker rank needs to build its part of the engine (picklable)."""

    source: str  # the model, as the user named it
    config: EngineConfig  # the driver's, device set to this rank's
    rank: int
    meeting: Rendezvous
    num_threads: int  # CPU: torch threads of this rank
    num_blocks: int  # every rank's cache has the driver's block count
    max_model_len: int


@dataclass(frozen=True)
class WorkerReady:
    rank: int


@dataclass(frozen=True)
class WorkerFailed:
    rank: int
    message: str


@dataclass(frozen=True)
class Stop:
    pass


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after the driver's on CUDA, the CPU otherwise."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def spawn_workers(specs: list[WorkerSpec]) -> list[multiprocessing.Process]:
    context = multiprocessing.get_context("spawn")  # never fork a process with torch threads
    processes = []
    for spec in specs:
        process = context.Process(
            target=run_worker, args=(spec,), name=f"pdcluster-tp-rank{spec.rank}", daemon=True
        )
        process.start()
        processes.append(process)
    return processes


def wait_ready(tp: TPGroup, processes: list[multiprocessing.Process]) -> None:
    """Driver: every worker's shard is loaded, or raise with the first failure's message."""
    try:
        replies = tp.receive_from_workers()
    except TensorParallelError as err:
        codes = {p.name: p.exitcode for p in processes if p.exitcode is not None}
        raise TensorParallelError(f"{err} while loading (exit codes {codes})") from None
    failed = [r for r in replies if isinstance(r, WorkerFailed)]
    if failed:
        raise TensorParallelError(
            f"tensor-parallel rank {failed[0].rank} failed to load: {failed[0].message}"
        )


def stop_workers(tp: TPGroup, processes: list[multiprocessing.Process]) -> None:
    """Driver: end every worker (gently, then by force after a few seconds)."""
    try:
        tp.send(Stop())
    except TensorParallelError:
        pass  # already gone
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    tp.close()


def run_worker(spec: WorkerSpec) -> None:
    """A worker process's whole life (the target of spawn_workers)."""
    from engine.checkpoint import Checkpoint
    from engine.kv_cache import PagedKVCache
    from engine.llm_engine import load_shard
    from engine.model_runner import ModelRunner, StepPlan

    logging.basicConfig(level=logging.WARNING)
    config = spec.config
    device = config.resolve_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(spec.num_threads)
    driver_pid = os.getppid()
    tp = TPGroup.join_as_worker(spec.meeting, spec.rank, device)
    tp.watch(lambda: os.getppid() == driver_pid)  # reparented: the driver is gone
    try:
        checkpoint = Checkpoint(spec.source)
        model, _ = load_shard(checkpoint, config, device, spec.max_model_len, tp, progress=False)
        kv_dtype = config.resolve_kv_cache_dtype(config.resolve_dtype(device))
        cache = PagedKVCache(model.config, spec.num_blocks, config.block_size, kv_dtype, device)
        runner = ModelRunner(model, cache)
    except Exception as err:  # the driver reports it as its own error
        tp.reply(WorkerFailed(spec.rank, f"{type(err).__name__}: {err}"))
        tp.close()
        return
    tp.reply(WorkerReady(spec.rank))
    try:
        while True:
            message = tp.receive()
            if isinstance(message, Stop):
                break
            assert isinstance(message, StepPlan), type(message)
            runner.forward(message)
    except TensorParallelError as err:
        logger.warning("tensor-parallel rank %d stops: %s", spec.rank, err)
    finally:
        tp.close()
