"""The controller (Ray actor ``controller``, on the node where ``pdcluster serve`` started):
owns the worker actors and keeps the pools at the size wanted.

- Start-up (``start``, then ``wait_started`` until done, then ``serve``): binds the router's
  ports first (actor ``router``, on the controller's node: a bind error ends start-up at
  once), brings up every pool's initial replicas side by side, then starts the router with
  them. A replica that cannot be placed is *pending* with a reason until its pool's
  ``placement_timeout_s``; at start-up that ends start-up with the reason.
- Every second (the control loop): replicas that died are taken out of the router's
  rotation and removed; each pool is brought back to its target (a replacement takes the
  lowest free index, so a dead ``decode-0`` comes back as ``decode-0``); what every wanted
  replica reserves is asked of Ray's autoscaler. Bring-ups and drains run as tasks of their
  own: a replica waiting for a node never holds up replacing, draining or planning.
- Every ``planner.interval_s`` (when the planner is enabled): reads the load from the router,
  asks the planner for each pool's size and sets the targets. A new replica joins the
  rotation once its model is loaded; scale-in cancels a pending replica first, else drains
  one (no new work, in-flight requests finish) and only then stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass

import ray
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster import replica as replicas
from cluster.config import ClusterConfig
from cluster.placement import AutoscalerRequests, release
from cluster.replica import LIVE, ReplicaRecord, ReplicaStartError, root_cause
from engine.errors import EngineError
from engine.load import EngineLoad
from kv_transfer.sharding import KVLayout, layout_problem
from router.actor import RouterActor
from workers.pool import Pool

logger = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 10.0  # a replica that does not answer info() this long is dead
ROUTER_START_TIMEOUT_S = 60.0  # the router actor's process start and bind
DRAIN_TIMEOUT_S = 600.0
RETRY_MAX_S = 60.0

__all__ = ["ClusterStartError", "Controller", "root_cause"]


@dataclass
class ControllerEvent:
    time: float
    kind: str  # scale | replace | ready | drain | stop | pending | error
    message: str


class ClusterStartError(EngineError):
    """The cluster could not start (a worker failed to load its model, the router could not
    bind its port, a replica could not be placed, say)."""


class Controller:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.replicas: dict[str, ReplicaRecord] = {}
        self.targets: dict[Pool, int] = {
            pool: getattr(config, pool).initial for pool in config.pools
        }
        self.router = None
        self.serving = False  # the router is started: ready replicas join its rotation
        self.urls: dict[str, str] = {}
        self.events: deque[ControllerEvent] = deque(maxlen=200)
        self.planner = None
        self.capacity: dict | None = None
        self._loop_task: asyncio.Task | None = None
        self._initial: list[ReplicaRecord] = []
        # After a bring-up fails, its pool's next one waits (2, 4, ... 60 s): a replica that
        # cannot load, or a node type that never comes, is not retried every second.
        self._failures: dict[Pool, int] = {}
        self._retry_at: dict[Pool, float] = {}
        self.layouts: dict[Pool, KVLayout] = {}  # each pool's KV layout, from its first replica
        self.autoscaler = AutoscalerRequests()
        self.registry = CollectorRegistry()  # the controller's series, appended to /metrics
        self._replica_gauge = Gauge(
            "pdcluster_replicas",
            "Replicas of each pool by state (pending: waiting to be placed)",
            ["pool", "state"],
            registry=self.registry,
        )
        self._pending_gauge = Gauge(
            "pdcluster_replica_pending_seconds",
            "How long each pending replica has waited to be placed",
            ["pool", "replica"],
            registry=self.registry,
        )
        self.planner_metrics = None

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> dict:
        """Bind the router's ports (on this node), start bringing up the initial replicas;
        returns the router's URLs. Raises ClusterStartError if the router cannot bind."""
        config = self.config
        self.router = (
            ray.remote(RouterActor)
            .options(
                name="router",
                namespace=config.namespace,
                num_cpus=0,
                max_concurrency=1000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    ray.get_runtime_context().get_node_id(), soft=False
                ),
            )
            .remote()
        )
        try:
            self.urls = await asyncio.wait_for(
                self.router.bind.remote(dataclasses.asdict(config.router)),
                timeout=ROUTER_START_TIMEOUT_S,
            )
        except asyncio.TimeoutError:
            raise ClusterStartError(
                f"the router did not start in {ROUTER_START_TIMEOUT_S:g} s"
            ) from None
        except Exception as err:  # noqa: BLE001 - a bind error, re-raised by Ray
            raise ClusterStartError(f"the router could not start: {root_cause(err)}") from None
        self._initial = [
            self._bring_up(pool) for pool in config.pools for _ in range(self.targets[pool])
        ]
        return self.urls

    async def wait_started(self, timeout_s: float = 2.0) -> dict:
        """Waits up to ``timeout_s`` for the initial replicas. ``done``: all ready, or one
        failed (``error`` says why); ``replicas``: each one's state and reason."""
        tasks = [r.task for r in self._initial]
        await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        error = next(
            (str(t.exception()) for t in tasks if t.done() and t.exception() is not None), None
        )
        return {
            "done": error is not None or all(t.done() for t in tasks),
            "error": error,
            "replicas": [self._view(r, time.monotonic()) for r in self._initial],
        }

    async def serve(self) -> dict:
        """Start the router with the initial replicas, the planner and the control loop."""
        config = self.config
        ready = {r.name: r.pool for r in self._initial if r.state == "ready"}
        if len(ready) < len(self._initial):
            raise ClusterStartError("serve() before every initial replica is ready")
        await self.router.start.remote(
            model=config.model,
            limits=dataclasses.asdict(config.limits),
            routing=dataclasses.asdict(config.routing),
            slo=dataclasses.asdict(config.slo),
            replicas=ready,
            colocated=config.mode == "colocated",
            namespace=config.namespace,
        )
        self.serving = True
        if config.planner.enabled:
            await self._start_planner()
        self._loop_task = asyncio.create_task(self._control_loop())
        return self.urls

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        records = list(self.replicas.values())
        for record in records:
            if record.task is not None and not record.task.done():
                record.task.cancel()
        if self.router is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.router.stop.remote(), timeout=replicas.STOP_TIMEOUT_S)
            ray.kill(self.router)
            self.router = None
        # Side by side: a shutdown with requests in flight ends in seconds, not per actor.
        await asyncio.gather(*(replicas.stop(r) for r in records), return_exceptions=True)
        self.replicas.clear()
        self.autoscaler.update([])  # nothing wanted any more: idle nodes may go

    # ---- replicas -------------------------------------------------------------------------
    def _bring_up(self, pool: Pool) -> ReplicaRecord:
        """A new replica of ``pool`` (pending), brought up by a task of its own."""
        pool_config = getattr(self.config, pool)
        record = ReplicaRecord(f"{pool}-{self._next_index(pool)}", pool, pool_config.shape())
        self.replicas[record.name] = record
        record.task = asyncio.create_task(self._run_bring_up(record, pool_config))
        # its error is in the events (and read by wait_started at start-up)
        record.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return record

    async def _run_bring_up(self, record: ReplicaRecord, pool_config) -> None:
        try:
            await replicas.bring_up(
                record,
                namespace=self.config.namespace,
                options=self.config.worker_options(record.pool),
                placement_timeout_s=pool_config.placement_timeout_s,
                check_info=lambda info: self._layout_problem(record.pool, KVLayout.from_info(info)),
            )
        except ReplicaStartError as err:
            self._forget(record)
            self._event("error", str(err))
            failures = self._failures[record.pool] = self._failures.get(record.pool, 0) + 1
            self._retry_at[record.pool] = time.monotonic() + min(2.0**failures, RETRY_MAX_S)
            raise
        except asyncio.CancelledError:
            self._forget(record)
            raise
        self._failures[record.pool] = 0
        self._event("ready", f"{record.name} ready on {record.node or 'its node'}")
        if self.serving:
            await self.router.add_replica.remote(record.name, record.pool)

    def _forget(self, record: ReplicaRecord) -> None:
        if self.replicas.get(record.name) is record:
            del self.replicas[record.name]

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
        used = {r.index for r in self.replicas.values() if r.pool == pool}
        index = 0
        while index in used:
            index += 1
        return index

    def _live(self, pool: Pool) -> list[ReplicaRecord]:
        return [r for r in self.replicas.values() if r.pool == pool and r.state in LIVE]

    async def scale(self, pool: str, replicas_wanted: int) -> list[str]:
        """Set ``pool``'s size by hand (within its min and max replicas); the control loop
        brings it there. Returns the pool's replicas now (new ones pending)."""
        pool = Pool(pool)
        bounds = getattr(self.config, pool)
        if not bounds.min <= replicas_wanted <= bounds.max:
            raise ValueError(
                f"pools.{pool}: {replicas_wanted} replicas is outside [{bounds.min}, {bounds.max}]"
            )
        self._resize(pool, replicas_wanted, "scaled by hand")
        await self._reconcile_sizes()
        return sorted(r.name for r in self._live(pool))

    async def drain_and_stop(self, name: str) -> None:
        """Take ``name`` out of rotation, wait for its requests to finish, stop it."""
        record = self.replicas[name]
        record.state = "draining"
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                in_flight = await self.router.drain_replica.remote(name)
                stats = await asyncio.wait_for(record.handle.stats.remote(), HEALTH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - it died while draining: nothing left to wait for
                break
            if in_flight == 0 and stats.unfinished == 0:
                break
            await asyncio.sleep(0.2)
        await self.router.remove_replica.remote(name)
        await replicas.stop(record)
        self._forget(record)
        self._event("stop", f"{name} drained and stopped")

    # ---- the control loop ------------------------------------------------------------------
    async def _control_loop(self) -> None:
        last_plan = time.monotonic()
        while True:
            await asyncio.sleep(RECONCILE_INTERVAL_S)
            try:
                await self._remove_dead()
                await self._reconcile_sizes()
                if (
                    self.planner is not None
                    and time.monotonic() - last_plan >= self.config.planner.interval_s
                ):
                    last_plan = time.monotonic()
                    await self._plan_and_apply()
                await self._publish_metrics()
            except Exception as err:  # noqa: BLE001 - the controller must keep running
                logger.exception("control loop")
                self._event("error", str(err))

    async def _remove_dead(self) -> None:
        """Every ready replica answers info() (side by side); one that cannot is removed,
        and the next reconcile brings up its replacement."""
        ready = [r for r in self.replicas.values() if r.state == "ready"]
        answers = await asyncio.gather(
            *(asyncio.wait_for(r.handle.info.remote(), HEALTH_TIMEOUT_S) for r in ready),
            return_exceptions=True,
        )
        for record, answer in zip(ready, answers, strict=True):
            if not isinstance(answer, BaseException) or record.state != "ready":
                continue
            reason = type(answer).__name__  # dead, or hung for HEALTH_TIMEOUT_S
            logger.warning("%s is gone (%s): replacing it", record.name, reason)
            self._forget(record)
            await self.router.remove_replica.remote(record.name)
            with contextlib.suppress(Exception):
                ray.kill(record.handle)
            release(record.group)
            record.state = "stopped"
            on = f" on {record.node}" if record.node else ""
            self._event("replace", f"{record.name}{on} died ({reason}); replacing it")

    async def _reconcile_sizes(self) -> None:
        """Bring each pool up to its target (scale-down goes through ``_apply``) and ask
        the autoscaler for every replica wanted."""
        for pool, target in self.targets.items():
            if time.monotonic() < self._retry_at.get(pool, 0.0):
                continue
            for _ in range(target - len(self._live(pool))):
                record = self._bring_up(pool)
                self._event("pending", f"+{record.name}: bringing it up")
        wanted = [r.shape for r in self.replicas.values() if r.state in (*LIVE, "draining")]
        self.autoscaler.update(wanted)

    async def _publish_metrics(self) -> None:
        now = time.monotonic()
        self._replica_gauge.clear()
        self._pending_gauge.clear()
        for pool in self.config.pools:
            for state in ("pending", "starting", "ready", "draining"):
                count = sum(r.state == state for r in self.replicas.values() if r.pool == pool)
                self._replica_gauge.labels(pool=str(pool), state=state).set(count)
        for r in self.replicas.values():
            if r.state == "pending":
                self._pending_gauge.labels(pool=str(r.pool), replica=r.name).set(now - r.created_at)
        await self.router.set_extra_metrics.remote(generate_latest(self.registry))

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
        self.planner_metrics = PlannerMetrics(self.registry)

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
        for decision in decisions:
            self._apply(decision)

    def _apply(self, decision) -> None:
        self._resize(decision.pool, decision.target, decision.reason)

    def _resize(self, pool: Pool, target: int, reason: str) -> None:
        """Set the pool's target: the control loop brings up what is missing; what is too
        many goes now, the pending first (nothing to drain), then the youngest ready (it
        holds the least cached prefixes), drained in the background."""
        live = self._live(pool)
        self.targets[pool] = target
        if target > len(live):
            self._event("scale", f"{pool} {len(live)} -> {target}: {reason}")
        excess = len(live) - target
        if excess <= 0:
            return
        order = {"pending": 0, "starting": 1, "ready": 2}
        victims = sorted(live, key=lambda r: (order[r.state], -(r.ready_at or 0)))[:excess]
        for record in victims:
            self._event("scale", f"-{record.name} ({record.state}): {reason}")
            if record.state == "ready":
                record.task = asyncio.create_task(self.drain_and_stop(record.name))
            elif record.task is not None:
                self._forget(record)
                record.task.cancel()  # its bring-up cleans up after itself

    def _event(self, kind: str, message: str) -> None:
        self.events.append(ControllerEvent(time.time(), kind, message))

    # ---- status ----------------------------------------------------------------------------
    def _view(self, record: ReplicaRecord, now: float, view=None) -> dict:
        load = view.stats.load if view is not None else EngineLoad()
        state = record.state
        if state == "ready" and record.age_s(now) < self.config.planner.warmup_s:
            state = "warming"
        return {
            "name": record.name,
            "state": state,
            "node": record.node,
            "reason": record.reason if record.state in ("pending", "failed") else "",
            "waited_s": round(now - record.created_at, 1),
            "age_s": round(record.age_s(now), 1),
            "running": load.running,
            "queued_tokens": load.queued_tokens,
            "kv_usage": round(load.kv_usage, 3),
            # prompt tokens its prefix cache served, of those looked up (None: none yet)
            "prefix_hit_rate": round(load.prefix_hit_tokens / load.prefix_query_tokens, 3)
            if load.prefix_query_tokens
            else None,
            "alive": view.alive if view is not None else record.state == "ready",
        }

    async def status(self) -> dict:
        now = time.monotonic()
        stats = {}
        if self.serving:
            stats = await self.router.replica_stats.remote()
        attainment = None
        if self.serving:
            slo = self.config.slo
            attainment = await self.router.slo_attainment.remote(60.0, slo.ttft_ms, slo.tpot_ms)
        pools: dict[str, list[dict]] = {}
        for record in sorted(self.replicas.values(), key=lambda r: r.name):
            view = self._view(record, now, stats.get(record.name))
            pools.setdefault(str(record.pool), []).append(view)
        decisions = []
        if self.planner is not None:
            decisions = [dataclasses.asdict(d) for d in list(self.planner.history)[-10:]]
        return {
            "mode": self.config.mode,
            "model": self.config.model,
            "urls": self.urls,
            "pools": pools,
            "targets": {str(pool): n for pool, n in self.targets.items()},
            "slo": dataclasses.asdict(self.config.slo),
            "slo_attainment_60s": attainment,
            "planner_enabled": self.planner is not None,
            "capacity": self.capacity,
            "decisions": decisions,
            "events": [dataclasses.asdict(e) for e in list(self.events)[-20:]],
        }
