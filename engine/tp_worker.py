"""The ranks 1..t-1 of a tensor-parallel engine: processes that load their shard of the
model, then run every forward pass the driver (rank 0, the LLMEngine) sends them.

Lifecycle: ``start_workers`` (driver) meets the workers (engine.tp_group), loads its own
shard meanwhile, and waits for each worker's ``WorkerReady`` — or its ``WorkerFailed``, whose
message becomes the driver's error. Then each worker loops: a ``StepPlan`` is one forward
pass (its all-reduces meet the driver's), ``Stop`` ends it. A worker whose driver is gone
(EOF on its socket) exits; the driver sees a gone worker as a TensorParallelError at its
next step. The processes are daemons: they never outlive the driver's process.

A worker actor may give every rank a **rank service** (``WorkerSpec.service``): what the
rank does beside the model, e.g. send or receive its own KV heads in a disaggregated
replica. The driver talks to the services with ``ToRank`` messages in the plan stream (so
they are ordered with the steps), each plan may carry data for them (``StepPlan.service``),
and a service answers with ``FromRank`` messages, which the driver's listener hands on.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig
from engine.tp_group import Rendezvous, TensorParallelError, TPGroup

logger = logging.getLogger(__name__)


class RankService(ABC):
    """A worker rank's part of its actor's work beyond the forward passes.

    Who calls: the rank's main loop (one thread): ``handle`` for each ``ToRank`` payload,
    ``layer_hook`` / ``after_forward`` around each forward with the plan's ``service`` data,
    ``stop`` once at the end. The service may run threads of its own; ``reply`` (given at
    construction) is safe from any of them. Errors raised here end the rank (and so the
    replica): a service must turn its requests' failures into replies itself."""

    def info(self) -> Any:
        """What the driver learns when the rank is ready (e.g. a receiver's address)."""
        return None

    @abstractmethod
    def handle(self, payload: Any) -> None: ...

    def layer_hook(self, step_data: Any) -> Callable[[int], None] | None:
        """The ``layer_done(i)`` callback of this step's forward, if the service needs one."""
        return None

    @abstractmethod
    def after_forward(self, step_data: Any) -> None:
        """Called after the step's forward (its KV is in this rank's cache)."""

    @abstractmethod
    def stop(self) -> None:
        """Release what the service holds."""


# (rank, cache, layout, reply) -> RankService; picklable (a frozen dataclass with __call__).
RankServiceFactory = Callable[..., RankService]


@dataclass(frozen=True)
class ToRank:
    """Driver → every worker rank's service (sent with the engine's lock held, so it is
    ordered with the steps' plans)."""

    payload: Any


@dataclass(frozen=True)
class FromRank:
    """A worker rank's service → the driver."""

    rank: int
    payload: Any


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
    service: RankServiceFactory | None = None


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    info: Any = None  # its service's info()


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


def wait_ready(tp: TPGroup, processes: list[multiprocessing.Process]) -> list[Any]:
    """Driver: every worker's shard is loaded, or raise with the first failure's message.
    Returns each worker rank's service info, in rank order."""
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
    return [r.info for r in replies]


def stop_workers(tp: TPGroup, processes: list[multiprocessing.Process]) -> None:
    """Driver: end every worker (gently, then by force after a few seconds)."""
    tp.stopping = True
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
    from engine.loader import shard_layout
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
        service = None
        if spec.service is not None:
            layout = shard_layout(checkpoint.config, tp)
            reply_lock = threading.Lock()

            def reply(payload: Any) -> None:
                with reply_lock:
                    tp.reply(FromRank(spec.rank, payload))

            service = spec.service(spec.rank, cache, layout, reply)
    except Exception as err:  # the driver reports it as its own error
        tp.reply(WorkerFailed(spec.rank, f"{type(err).__name__}: {err}"))
        tp.close()
        return
    tp.reply(WorkerReady(spec.rank, service.info() if service is not None else None))
    try:
        while True:
            message = tp.receive()
            if isinstance(message, Stop):
                break
            if isinstance(message, ToRank):
                service.handle(message.payload)
                continue
            assert isinstance(message, StepPlan), type(message)
            if service is None or message.service is None:
                runner.forward(message)
                continue
            runner.forward(message, service.layer_hook(message.service))
            service.after_forward(message.service)
    except TensorParallelError as err:
        logger.warning("tensor-parallel rank %d stops: %s", spec.rank, err)
    finally:
        if service is not None:
            service.stop()
        tp.close()
