"""The controller (Ray actor ``controller``): owns the worker actors and keeps the pools at
the size the planner wants.

- Start-up: starts every pool's initial replicas, waits until each has loaded its model,
  starts the router (actor ``router``) with them.
- Every second: replicas that died are removed from the router's rotation and replaced by
  a new actor of the same name (their requests are retried or migrated by the router).
- Every ``planner.interval_s`` (when the planner is enabled): reads the load from the router,
  asks the planner for each pool's size and applies it. A new replica joins the rotation once
  its model is loaded; scale-in drains a replica (no new work, in-flight requests finish) and
  only then stops it, so scaling never loses or cuts a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import ray
from prometheus_client import CollectorRegistry, generate_latest

from cluster.config import ClusterConfig
from decode_worker.colocated import ColocatedWorker
from decode_worker.worker import DecodeWorker
from engine.errors import EngineError
from engine.load import EngineLoad
from kv_transfer.sharding import KVLayout, layout_problem
from prefill_worker.worker import PrefillWorker
from router.actor import RouterActor
from workers.pool import Pool

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 3.0  # per actor's own shutdown, before it is killed

WORKER_CLASSES = {
    Pool.PREFILL: PrefillWorker,
    Pool.DECODE: DecodeWorker,
    Pool.COLOCATED: ColocatedWorker,
}
# Prefill calls block a thread each while their prompt waits in the engine's queue.
CONCURRENCY = {Pool.PREFILL: 512, Pool.DECODE: 64, Pool.COLOCATED: 64}
RECONCILE_INTERVAL_S = 1.0
DRAIN_TIMEOUT_S = 600.0


@dataclass
class ReplicaRecord:
    name: str
    pool: Pool
    handle: Any
    state: str = "starting"  # starting | ready | draining | stopped
    ready_at: float | None = None

    def age_s(self, now: float) -> float:
        return 0.0 if self.ready_at is None else now - self.ready_at


@dataclass
class ControllerEvent:
    time: float
    kind: str  # scale | replace | drain | stop | error
    message: str


class ClusterStartError(EngineError):
    """The cluster could not start (a worker failed to load its model, say)."""


def root_cause(err: BaseException) -> str:
    """The innermost error of a Ray failure chain, as 'Kind: message' (Ray wraps an actor's
    own exception in RayTaskError / ActorDiedError layers with tracebacks)."""
    while getattr(err, "cause", None) is not None and err.cause is not err:
        err = err.cause
    if isinstance(err, ray.exceptions.RayError):  # the cause survives only as text
        last = str(err).strip().splitlines()[-1]
        return re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", last)  # engine.errors.X: → X:
    return f"{type(err).__name__}: {err}"


class Controller:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.replicas: dict[str, ReplicaRecord] = {}
        self.router = None
        self.urls: dict[str, str] = {}
        self.events: deque[ControllerEvent] = deque(maxlen=200)
        self.planner = None
        self.capacity: dict | None = None
        self._loop_task: asyncio.Task | None = None
        self._busy = asyncio.Lock()  # one scaling/replacement action at a time
        self.layouts: dict[Pool, KVLayout] = {}  # each pool's KV layout, from its first replica

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> dict:
        config = self.config
        pools = config.pools
        records = [
            self._create(pool, index)
            for pool in pools
            for index in range(getattr(config, pool).initial)
        ]
        await asyncio.gather(*(self._wait_ready(r) for r in records))
        self.router = (
            ray.remote(RouterActor)
            .options(name="router", namespace=config.namespace, num_cpus=0, max_concurrency=1000)
            .remote()
        )
        self.urls = await self.router.start.remote(
            model=config.model,
            router_config=dataclasses.asdict(config.router),
            limits=dataclasses.asdict(config.limits),
            slo=dataclasses.asdict(config.slo),
            replicas={r.name: r.pool for r in records},
            colocated=config.mode == "colocated",
            namespace=config.namespace,
        )
        if config.planner.enabled:
            await self._start_planner()
        self._loop_task = asyncio.create_task(self._control_loop())
        return self.urls

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        if self.router is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.router.stop.remote(), timeout=STOP_TIMEOUT_S)
            ray.kill(self.router)
            self.router = None
        # Side by side: a shutdown with requests in flight ends in seconds, not per actor.
        await asyncio.gather(*(self._stop_actor(r) for r in list(self.replicas.values())))
        self.replicas.clear()

    # ---- replicas -------------------------------------------------------------------------
    def _create(self, pool: Pool, index: int) -> ReplicaRecord:
        config = self.config
        pool_config = getattr(config, pool)
        name = f"{pool}-{index}"
        handle = (
            ray.remote(WORKER_CLASSES[pool])
            .options(
                name=name,
                namespace=config.namespace,
                num_cpus=pool_config.num_cpus,
                num_gpus=pool_config.num_gpus,
                max_concurrency=CONCURRENCY[pool],
            )
            .remote(config.worker_options(pool), name)
        )
        record = ReplicaRecord(name, pool, handle)
        self.replicas[name] = record
        return record

    async def _wait_ready(self, record: ReplicaRecord) -> None:
        try:
            info = await record.handle.info.remote()  # returns once the model is loaded
        except ray.exceptions.RayActorError as err:
            raise ClusterStartError(f"{record.name} could not start: {root_cause(err)}") from None
        problem = self._layout_problem(record.pool, KVLayout.from_info(info))
        if problem is not None:  # refused now, not at its first request
            await self._stop_actor(record)
            raise ClusterStartError(problem)
        record.state = "ready"
        record.ready_at = time.monotonic()

    def _layout_problem(self, pool: Pool, layout: KVLayout) -> str | None:
        """Why a replica of ``pool`` with ``layout`` cannot exchange KV with the other pool
        (the first replica registered there stands for it); None if it can."""
        self.layouts[pool] = self.layouts.get(pool, layout)
        if pool not in (Pool.PREFILL, Pool.DECODE):
            return None
        other = self.layouts.get(Pool.DECODE if pool == Pool.PREFILL else Pool.PREFILL)
        if other is None:
            return None
        prefill, decode = (layout, other) if pool == Pool.PREFILL else (other, layout)
        kv = self.config.kv
        return layout_problem(prefill, decode, wire_dtype=kv.wire_dtype, transport=kv.transport)

    def _next_index(self, pool: Pool) -> int:
        used = {int(name.rsplit("-", 1)[1]) for name, r in self.replicas.items() if r.pool == pool}
        index = 0
        while index in used:
            index += 1
        return index

    async def add_replica(self, pool: Pool) -> str:
        record = self._create(pool, self._next_index(pool))
        try:
            await self._wait_ready(record)
        except Exception:
            self.replicas.pop(record.name, None)
            raise
        await self.router.add_replica.remote(record.name, pool)
        return record.name

    async def drain_and_stop(self, name: str) -> None:
        """Take ``name`` out of rotation, wait for its requests to finish, stop it."""
        record = self.replicas[name]
        record.state = "draining"
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            in_flight = await self.router.drain_replica.remote(name)
            stats = await record.handle.stats.remote()
            if in_flight == 0 and stats.unfinished == 0:
                break
            await asyncio.sleep(0.2)
        await self.router.remove_replica.remote(name)
        await self._stop_actor(record)
        self.replicas.pop(name, None)

    async def _stop_actor(self, record: ReplicaRecord) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(record.handle.shutdown.remote(), timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(Exception):
            ray.kill(record.handle)
        record.state = "stopped"

    # ---- the control loop ------------------------------------------------------------------
    async def _control_loop(self) -> None:
        last_plan = time.monotonic()
        while True:
            await asyncio.sleep(RECONCILE_INTERVAL_S)
            try:
                async with self._busy:
                    await self._replace_dead()
                if (
                    self.planner is not None
                    and time.monotonic() - last_plan >= self.config.planner.interval_s
                ):
                    last_plan = time.monotonic()
                    async with self._busy:
                        await self._plan_and_apply()
            except Exception as err:  # noqa: BLE001 - the controller must keep running
                logger.exception("control loop")
                self.events.append(ControllerEvent(time.time(), "error", str(err)))

    async def _replace_dead(self) -> None:
        for record in list(self.replicas.values()):
            if record.state != "ready":
                continue
            try:
                await asyncio.wait_for(record.handle.info.remote(), timeout=10)
                continue
            except Exception as err:  # noqa: BLE001 - dead, or hung for 10 s
                reason = type(err).__name__
            logger.warning("%s is gone (%s): replacing it", record.name, reason)
            await self.router.remove_replica.remote(record.name)
            with contextlib.suppress(Exception):
                ray.kill(record.handle)
            self.replicas.pop(record.name, None)
            replacement = self._create(record.pool, int(record.name.rsplit("-", 1)[1]))
            try:
                await self._wait_ready(replacement)
            except Exception as err:  # noqa: BLE001 - try again next round
                self.replicas.pop(replacement.name, None)
                self.events.append(
                    ControllerEvent(time.time(), "error", f"replacing {record.name}: {err}")
                )
                continue
            await self.router.add_replica.remote(replacement.name, replacement.pool)
            self.events.append(
                ControllerEvent(time.time(), "replace", f"{record.name} died ({reason}); replaced")
            )

    async def _start_planner(self) -> None:
        from cluster.planner import Planner
        from cluster.planner_metrics import PlannerMetrics
        from cluster.planner_model import PoolCapacity

        config = self.config
        prefill = next(r for r in self.replicas.values() if r.pool == config.prefill_pool)
        decode = next(r for r in self.replicas.values() if r.pool == config.decode_pool)
        prefill_cap = await prefill.handle.calibrate.remote()
        decode_cap = prefill_cap if decode is prefill else await decode.handle.calibrate.remote()
        if "max_num_seqs" not in decode_cap:
            decode_cap = {**decode_cap, **(await decode.handle.calibrate.remote())}
        self.capacity = {"prefill": prefill_cap, "decode": decode_cap}
        capacity = PoolCapacity(
            prefill_tokens_per_s=prefill_cap["prefill_tokens_per_s"],
            decode_step_s_base=decode_cap["decode_step_s_base"],
            decode_step_s_per_seq=decode_cap["decode_step_s_per_seq"],
            decode_max_seqs=int(decode_cap["max_num_seqs"]),
        )
        pools = (
            {Pool.COLOCATED: config.colocated}
            if config.mode == "colocated"
            else {Pool.PREFILL: config.prefill, Pool.DECODE: config.decode}
        )
        self.planner = Planner(
            config.slo, config.planner, pools, capacity, colocated=config.mode == "colocated"
        )
        self.planner_registry = CollectorRegistry()
        self.planner_metrics = PlannerMetrics(self.planner_registry)

    async def _plan_and_apply(self) -> None:
        from cluster.planner_model import Observation, ReplicaState

        config = self.config
        now = time.monotonic()
        warming = [r.name for r in self.replicas.values() if r.age_s(now) < config.planner.warmup_s]
        window = max(config.planner.interval_s * 3, 10.0)
        raw = await self.router.observation.remote(window, config.slo.percentile, warming)
        stats = raw["replicas"]
        prefill = [v.stats for v in stats.values() if v.pool.computes_prompts]
        decode = [v.stats for v in stats.values() if v.pool.decodes]
        observation = Observation(
            time_s=now,
            window_s=window,
            arrival_rate=raw["arrival_rate"],
            mean_input_len=raw["mean_input_len"],
            mean_output_len=raw["mean_output_len"],
            ttft_ms=raw["ttft_ms"],
            tpot_ms=raw["tpot_ms"],
            prefill_queue_tokens=sum(s.load.queued_tokens for s in prefill),
            prefill_queue_time_s=max((s.load.oldest_wait_s for s in prefill), default=0.0),
            decode_waiting=int(raw["router_waiting"]),
            decode_running=sum(s.load.running for s in decode),
            decode_pending=sum(s.decode.pending_transfers for s in decode if s.decode is not None),
            replicas=tuple(
                ReplicaState(
                    name=r.name, pool=r.pool, age_s=r.age_s(now), draining=r.state == "draining"
                )
                for r in self.replicas.values()
                if r.state in ("ready", "draining")
            ),
        )
        decisions = self.planner.decide(observation)
        self.planner_metrics.record(decisions, self.planner)
        await self.router.set_extra_metrics.remote(generate_latest(self.planner_registry))
        for decision in decisions:
            await self._apply(decision)

    async def _apply(self, decision) -> None:
        current = [
            r for r in self.replicas.values() if r.pool == decision.pool and r.state == "ready"
        ]
        if decision.target > len(current):
            # Started together; each joins the rotation as soon as its model is loaded.
            names = await asyncio.gather(
                *(self.add_replica(decision.pool) for _ in range(decision.target - len(current))),
                return_exceptions=True,
            )
            for name in names:
                if isinstance(name, BaseException):
                    message = f"scale up {decision.pool}: {name}"
                    self.events.append(ControllerEvent(time.time(), "error", message))
                else:
                    message = f"+{name}: {decision.reason}"
                    self.events.append(ControllerEvent(time.time(), "scale", message))
        elif decision.target < len(current):
            # Drain the youngest: it holds the least cached prefixes.
            victims = sorted(current, key=lambda r: r.ready_at or 0, reverse=True)[
                : len(current) - decision.target
            ]
            for record in victims:
                self.events.append(
                    ControllerEvent(time.time(), "scale", f"-{record.name}: {decision.reason}")
                )
                await self.drain_and_stop(record.name)

    # ---- status ----------------------------------------------------------------------------
    async def status(self) -> dict:
        now = time.monotonic()
        stats = await self.router.replica_stats.remote() if self.router is not None else {}
        attainment = None
        if self.router is not None:
            slo = self.config.slo
            attainment = await self.router.slo_attainment.remote(60.0, slo.ttft_ms, slo.tpot_ms)
        pools: dict[str, list[dict]] = {}
        for record in sorted(self.replicas.values(), key=lambda r: r.name):
            view = stats.get(record.name)
            load = view.stats.load if view is not None else EngineLoad()
            pools.setdefault(str(record.pool), []).append(
                {
                    "name": record.name,
                    "state": record.state
                    if record.age_s(now) >= self.config.planner.warmup_s or record.state != "ready"
                    else "warming",
                    "age_s": round(record.age_s(now), 1),
                    "running": load.running,
                    "queued_tokens": load.queued_tokens,
                    "kv_usage": round(load.kv_usage, 3),
                    "alive": view.alive if view is not None else record.state == "ready",
                }
            )
        decisions = []
        if self.planner is not None:
            decisions = [dataclasses.asdict(d) for d in list(self.planner.history)[-10:]]
        return {
            "mode": self.config.mode,
            "model": self.config.model,
            "urls": self.urls,
            "pools": pools,
            "slo": dataclasses.asdict(self.config.slo),
            "slo_attainment_60s": attainment,
            "planner_enabled": self.planner is not None,
            "capacity": self.capacity,
            "decisions": decisions,
            "events": [dataclasses.asdict(e) for e in list(self.events)[-20:]],
        }
