"""One replica as the controller tracks it, from its placement to its end.

    pending ──placed──▶ starting ──model loaded──▶ ready ──drain──▶ draining ──▶ stopped
       └─ deadline / cancelled ─┴─ failed to load ──▶ failed          └─ died ──▶ replaced

``bring_up`` runs a replica from pending to ready as one asyncio task of the controller's
event loop (many side by side: a replica waiting for a node never holds up another, nor the
control loop); ``stop`` ends it and frees what it reserved. Errors: ``bring_up`` raises
``ReplicaStartError`` with the reason after cleaning up after itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster import placement
from cluster.replica_shape import ReplicaShape
from decode_worker.colocated import ColocatedWorker
from decode_worker.worker import DecodeWorker
from engine.errors import EngineError
from prefill_worker.worker import PrefillWorker
from workers.pool import Pool

WORKER_CLASSES = {
    Pool.PREFILL: PrefillWorker,
    Pool.DECODE: DecodeWorker,
    Pool.COLOCATED: ColocatedWorker,
}
# Prefill calls block a thread each while their prompt waits in the engine's queue.
CONCURRENCY = {Pool.PREFILL: 512, Pool.DECODE: 64, Pool.COLOCATED: 64}
STOP_TIMEOUT_S = 3.0  # per actor's own shutdown, before it is killed
REASON_REFRESH_S = 2.0  # how often a pending replica's reason is read again
LIVE = ("pending", "starting", "ready")  # states that count toward a pool's size


class ReplicaStartError(EngineError):
    """A replica could not be placed or started; the message says why."""


@dataclass
class ReplicaRecord:
    name: str
    pool: Pool
    shape: ReplicaShape
    state: str = "pending"  # pending | starting | ready | draining | stopped | failed
    reason: str = "placing"  # why it is pending (or failed)
    node: str = ""  # the IP of its node, once placed
    handle: Any = None
    group: Any = None  # its placement group
    created_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    task: asyncio.Task | None = None  # its bring-up, then its drain

    def age_s(self, now: float) -> float:
        return 0.0 if self.ready_at is None else now - self.ready_at

    @property
    def index(self) -> int:
        return int(self.name.rsplit("-", 1)[1])


def root_cause(err: BaseException) -> str:
    """The innermost error of a Ray failure chain, as 'Kind: message' (Ray wraps an actor's
    own exception in RayTaskError / ActorDiedError layers with tracebacks)."""
    while getattr(err, "cause", None) is not None and err.cause is not err:
        err = err.cause
    if isinstance(err, ray.exceptions.RayError):  # the cause survives only as text
        last = str(err).strip().splitlines()[-1]
        return re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", last)  # engine.errors.X: → X:
    return f"{type(err).__name__}: {err}"


async def bring_up(
    record: ReplicaRecord,
    *,
    namespace: str,
    options: dict,
    placement_timeout_s: float,
    check_info: Callable[[dict], str | None],
) -> dict:
    """Place ``record``, start its actor, wait for its model; returns its ``info()``.
    ``check_info`` names a reason to refuse the loaded replica (its KV layout), or None."""
    try:
        await _place(record, namespace, placement_timeout_s)
        record.state, record.reason = "starting", ""
        record.handle = (
            ray.remote(WORKER_CLASSES[record.pool])
            .options(
                name=record.name,
                namespace=namespace,
                num_cpus=record.shape.bundle.get("CPU", 0.0),
                num_gpus=record.shape.bundle.get("GPU", 0.0),
                resources={k: v for k, v in record.shape.bundle.items() if k not in ("CPU", "GPU")},
                max_concurrency=CONCURRENCY[record.pool],
                scheduling_strategy=PlacementGroupSchedulingStrategy(record.group, 0),
            )
            .remote(options, record.name)
        )
        try:
            info = await record.handle.info.remote()  # returns once the model is loaded
        except ray.exceptions.RayActorError as err:
            raise ReplicaStartError(f"{record.name} could not start: {root_cause(err)}") from None
        problem = check_info(info)
        if problem is not None:
            raise ReplicaStartError(problem)
    except BaseException as err:
        record.reason = str(err) if isinstance(err, ReplicaStartError) else repr(err)
        await stop(record)
        record.state = "failed"
        if isinstance(err, ReplicaStartError | asyncio.CancelledError):
            raise
        raise ReplicaStartError(f"{record.name} could not start: {root_cause(err)}") from None
    record.state, record.ready_at = "ready", time.monotonic()
    return info


async def _place(record: ReplicaRecord, namespace: str, timeout_s: float) -> None:
    record.group = placement.reserve(record.shape, f"{namespace}:{record.name}:{id(record)}")
    ready = asyncio.wrap_future(record.group.ready().future())
    deadline = record.created_at + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ReplicaStartError(
                f"{record.name} was not placed in {timeout_s:g} s ({record.reason}); given up"
            )
        done, _ = await asyncio.wait({ready}, timeout=min(REASON_REFRESH_S, left))
        if done:
            ready.result()
            break
        record.reason = placement.pending_reason(record.shape)
    record.node = placement.node_address(record.group)


async def stop(record: ReplicaRecord) -> None:
    """End the actor (its own shutdown first, briefly) and free its placement group."""
    if record.handle is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(record.handle.shutdown.remote(), timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(Exception):
            ray.kill(record.handle)
    placement.release(record.group)
    record.group = None
    record.state = "stopped"
