"""The discrete-event core: arrivals, prefill batches, KV transfers, decode joins and
leaves, planner ticks, replicas starting and draining. See ``cluster_model`` for what each
entity does; this file is the loop and the bookkeeping.

The planner is :class:`cluster.planner.Planner` itself, fed an :class:`Observation` built
from the simulated router's window exactly as the controller builds it from the real one.
"""

from __future__ import annotations

import heapq
import math
import random

import numpy as np

from cluster.planner import Planner
from cluster.planner_model import Decision, Observation, ReplicaState
from cluster.simulator.cluster_model import Replica, SimConfig
from cluster.simulator.result import SimResult
from cluster.simulator.serving import cpu_slowdown
from cluster.simulator.workload import Workload
from workers.pool import Pool

PREFILL_DONE, DECODE_JOIN, DECODE_NEXT, READY, TICK = range(5)


class Simulation:
    """One run of ``workload`` through the cluster ``config``. ``run()`` returns a SimResult.

    Ends when every request has finished, or at ``horizon_s`` (default: last arrival plus
    ten minutes) with the rest unfinished."""

    def __init__(self, config: SimConfig, workload: Workload, horizon_s: float | None = None):
        self.c = config
        self.w = workload
        self.arr = workload.arrival_s.tolist()
        self.inp = workload.input_len.tolist()
        self.out = workload.output_len.tolist()
        n = len(self.arr)
        self.first = [math.nan] * n
        self.done = [math.nan] * n
        self.enqueued = [0.0] * n
        self.cold = bytearray(n)  # 1: TTFT from a warming prefill, 2: TPOT from a warming decode
        self.horizon = horizon_s if horizon_s is not None else workload.duration_s + 600.0
        self.rng = random.Random(config.seed)
        self.events: list = []
        self.seq = 0
        self.t = 0.0
        seat_pool = Pool.COLOCATED if config.mode == "colocated" else Pool.DECODE
        self.kv_tokens = config.kv_tokens or config.cost_for(seat_pool).kv_capacity_tokens()
        self.costs = {pool: config.cost_for(pool) for pool in Pool}
        self.transfer = config.transfer_cost()
        self.replicas: list[Replica] = []
        self.routable: dict[str, list[Replica]] = {p: [] for p in config.pools}
        self.waiting: list[int] = []  # router queue for decode seats (FIFO via index)
        self.wait_head = 0
        self.slowdown = 1.0  # the host's CPU contention (serving.cpu_slowdown); 1 unless shared
        self.gpu_seconds = 0.0
        self.gpus = 0
        self.gpu_t = 0.0
        self.counter = 0
        self.ticks: list[dict] = []
        self.decisions: list[Decision] = []
        self.win: dict = self._new_window()
        self.planner: Planner | None = None
        if config.planner.enabled:
            capacity = config.capacity or config.planner_capacity(
                float(np.mean(workload.input_len)) if n else 512.0,
                float(np.mean(workload.output_len)) if n else 128.0,
            )
            self.planner = Planner(
                config.slo,
                config.planner,
                config.pools,
                capacity,
                colocated=config.mode == "colocated",
            )
        for pool, pc in config.pools.items():
            for _ in range(pc.initial):
                self._add_replica(pool, ready_at=0.0)

    # ---- replicas ---------------------------------------------------------------------------
    def _count_gpus(self, delta: int) -> None:
        self.gpu_seconds += self.gpus * (self.t - self.gpu_t)
        self.gpu_t = self.t
        self.gpus += delta

    def _add_replica(self, pool: Pool, ready_at: float) -> Replica:
        r = Replica(f"{pool}-{self.counter}", pool, self.t, ready_at, self.kv_tokens)
        r.t_last = ready_at
        self.counter += 1
        self.replicas.append(r)
        self._count_gpus(self.c.tp(pool))
        if ready_at <= self.t:
            self._ready(r)
        else:
            self._push(ready_at, READY, r, 0)
        return r

    def _ready(self, r: Replica) -> None:
        r.ready = True
        r.t_last = self.t
        if not r.draining:
            self.routable[r.pool].append(r)
            self._admit_waiting()

    def _drain(self, pool: Pool, count: int) -> None:
        # Starting ones first (nothing to drain), then the least loaded ready ones.
        live = [r for r in self.replicas if r.pool == pool and not r.draining and not r.removed]
        live.sort(key=lambda r: (r.ready, r.seats + r.outstanding_tokens, -r.created_t))
        for r in live[:count]:
            r.draining = True
            if r in self.routable[pool]:
                self.routable[pool].remove(r)
            self._maybe_remove(r)

    def _maybe_remove(self, r: Replica) -> None:
        if r.draining and not r.removed and (r.idle or not r.ready):
            r.removed = True
            self._count_gpus(-self.c.tp(r.pool))

    # ---- events -----------------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj, arg) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj, arg))

    def run(self) -> SimResult:
        arr, n = self.arr, len(self.arr)
        events, pop = self.events, heapq.heappop
        if self.planner is not None:
            self._push(self.c.planner.interval_s, TICK, None, 0)
        i = 0
        while True:
            next_arrival = arr[i] if i < n else math.inf
            if events and events[0][0] <= next_arrival:
                t, _, kind, obj, arg = pop(events)
                if t > self.horizon:
                    break
                self.t = t
                if kind == DECODE_NEXT:
                    if arg == obj.version:
                        self._decode_next(obj)
                elif kind == PREFILL_DONE:
                    self._prefill_done(obj)
                elif kind == DECODE_JOIN:
                    self._join(obj, arg)
                elif kind == TICK:
                    self._tick()
                    if i < n or self._busy():
                        self._push(t + self.c.planner.interval_s, TICK, None, 0)
                elif kind == READY and not obj.removed:
                    self._ready(obj)
            elif i < n:
                if next_arrival > self.horizon:
                    break
                self.t = next_arrival
                self._arrive(i)
                i += 1
            else:
                break
        self._count_gpus(0)
        return SimResult(
            self.c,
            self.w.arrival_s,
            np.array(self.first) - self.w.arrival_s,
            self._tpot(),
            self.t,
            self.gpu_seconds,
            self.ticks,
            self.decisions,
        )

    def _tpot(self) -> np.ndarray:
        first, done, out = np.array(self.first), np.array(self.done), np.array(self.out)
        return np.where(
            out > 1, (done - first) / np.maximum(out - 1, 1), np.where(np.isnan(done), np.nan, 0.0)
        )

    def _busy(self) -> bool:
        return any(not r.idle for r in self.replicas if not r.removed) or self.wait_head < len(
            self.waiting
        )

    # ---- the router -------------------------------------------------------------------------
    def _pick(self, pool: Pool, key) -> Replica | None:
        cands = self.routable[pool]
        d = self.c.route_choices
        if len(cands) > d:
            # d neighbours from a random start: power-of-d choices at a random draw's cost.
            start = int(self.rng.random() * len(cands))
            cands = (
                (cands + cands[:d])[start : start + d]
                if start + d > len(cands)
                else cands[start : start + d]
            )
        return min(cands, key=key, default=None)

    def _arrive(self, rid: int) -> None:
        w = self.win
        w["arrivals"] += 1
        w["in"] += self.inp[rid]
        w["out"] += self.out[rid]
        if self.wait_head < len(self.waiting) or not self._reserve(rid):
            self.waiting.append(rid)

    def _seat_pool(self) -> str:
        return Pool.COLOCATED if self.c.mode == "colocated" else Pool.DECODE

    def _reserve(self, rid: int, target: Replica | None = None) -> bool:
        need = self.inp[rid] + self.out[rid]
        seats = self.c.seats
        if target is None:
            pool = self._seat_pool()
            if pool == Pool.COLOCATED:
                target = self._pick(
                    pool,
                    lambda r: (r.seats >= seats or r.kv_free < need, r.outstanding_tokens, r.seats),
                )
            else:
                target = self._pick(pool, lambda r: (r.seats, -r.kv_free))
            if target is None:
                return False
            if (target.seats >= seats or target.kv_free < need) and len(
                self.routable[pool]
            ) > self.c.route_choices:
                # The sample was full: look at every replica before making the request wait.
                free = [r for r in self.routable[pool] if r.seats < seats and r.kv_free >= need]
                target = min(free, key=lambda r: r.seats, default=target)
        if target.seats >= seats or target.kv_free < need:
            return False
        target.seats += 1
        target.kv_free -= need
        self.enqueued[rid] = self.t
        if self.c.mode == "colocated":
            self._enqueue_prefill(target, rid, target)
        else:
            p = self._pick(Pool.PREFILL, lambda r: r.outstanding_tokens)
            if p is None:  # no prefill replica: give the seat back, wait
                target.seats -= 1
                target.kv_free += need
                return False
            self._enqueue_prefill(p, rid, target)
        return True

    def _admit_waiting(self, freed: Replica | None = None) -> None:
        while self.wait_head < len(self.waiting):
            rid = self.waiting[self.wait_head]
            if freed is not None:  # only its seat is new: the others were full already
                if not freed.ready or freed.draining or not self._reserve(rid, freed):
                    break
            elif not self._reserve(rid):
                break
            self.wait_head += 1
        if self.wait_head > 4096 and self.wait_head * 2 > len(self.waiting):
            del self.waiting[: self.wait_head]
            self.wait_head = 0

    # ---- prefill ----------------------------------------------------------------------------
    def _enqueue_prefill(self, p: Replica, rid: int, decode: Replica) -> None:
        p.queue.append((rid, decode))
        p.queued_tokens += self.inp[rid]
        if not p.batch:
            self._start_batch(p)

    def _start_batch(self, p: Replica) -> None:
        if p.batch or not p.queue:
            return
        budget, inp = self.c.max_batched_tokens, self.inp
        batch, tokens, sq = [], 0, 0.0
        while p.queue:
            rid = p.queue[0][0]
            n = inp[rid]
            if batch and tokens + n > budget:
                break
            batch.append(p.queue.popleft())
            tokens += n
            sq += n * n
        p.batch = batch
        p.batch_tokens = tokens
        p.queued_tokens -= tokens
        if p.pool == Pool.COLOCATED:  # the decode clock stops while the prefill runs
            p.advance(self.t)
            p.paused = True
            p.version += 1
        self._update_host()  # one more busy loop
        # The batch keeps the slowdown it started with (changes while it runs are not seen).
        seconds = self.costs[p.pool].prefill_time(tokens, sq, len(batch))
        seconds *= self.c.serving.prefill_factor
        self._push(self.t + seconds * self.slowdown, PREFILL_DONE, p, 0)

    def _prefill_done(self, p: Replica) -> None:
        t = self.t
        cold = p.age(t) < self.c.planner.warmup_s
        request_s = self.c.serving.request_s
        batch = p.batch  # stays set until the loop ends: no nested batch starts meanwhile
        for rid, d in batch:
            self.first[rid] = t + request_s
            if cold:
                self.cold[rid] |= 1
            self.win["ttft"].append((t + request_s - self.arr[rid], rid))
            if p.pool == Pool.COLOCATED:
                self._join(d, rid, now=True)
            else:
                moved = self.transfer.transfer_time(self.inp[rid])
                self._push(t + moved + request_s, DECODE_JOIN, d, rid)
        p.batch = []
        p.batch_tokens = 0
        self._update_host()
        if p.pool == Pool.COLOCATED:
            p.paused = False
            p.t_last = t
            self._reschedule(p)
        self._start_batch(p)
        self._maybe_remove(p)

    # ---- decode -----------------------------------------------------------------------------
    def _join(self, d: Replica, rid: int, now: bool = False) -> None:
        out = self.out[rid]
        if out <= 1:
            self.done[rid] = self.t
            self._leave(d, rid)
            return
        d.advance(self.t)
        if d.age(self.t) < self.c.planner.warmup_s:
            self.cold[rid] |= 2
        heapq.heappush(d.heap, (d.S + out - 1, rid))
        d.ctx += self.inp[rid] + out / 2
        self._reschedule(d)

    def _reschedule(self, d: Replica) -> None:
        d.version += 1
        if not d.heap or d.paused:
            d.base_step_s = 0.0
            self._update_host()
            return
        d.base_step_s = self.costs[d.pool].decode_step_time(len(d.heap), d.ctx)
        d.base_step_s *= self.c.serving.decode_factor
        if not self._update_host():  # else every decode clock was rescheduled already
            self._schedule_next(d)

    def _schedule_next(self, d: Replica) -> None:
        d.step_s = d.base_step_s * self.slowdown
        self._push(self.t + max(d.heap[0][0] - d.S, 0.0) * d.step_s, DECODE_NEXT, d, d.version)

    def _update_host(self) -> bool:
        """Where the pools share CPU cores: recompute the slowdown from the busy loops and
        the decode token rate; if it changed, move every decode clock to now and reschedule
        it at the new speed. Returns True when it rescheduled."""
        serving = self.c.serving
        if not serving.shares_cpu:
            return False
        busy, rate = 0, 0.0
        for r in self.replicas:
            if r.removed:
                continue
            decoding = bool(r.heap) and not r.paused and r.base_step_s > 0
            busy += bool(r.batch) or decoding
            if decoding:
                rate += len(r.heap) / r.base_step_s
        slowdown = cpu_slowdown(serving, busy, rate)
        if slowdown == self.slowdown:
            return False
        self.slowdown = slowdown
        for r in self.replicas:
            if r.heap and not r.paused and r.base_step_s > 0 and not r.removed:
                r.advance(self.t)
                r.version += 1
                self._schedule_next(r)
        return True

    def _decode_next(self, d: Replica) -> None:
        d.advance(self.t)
        heap, out, inp = d.heap, self.out, self.inp
        while heap and heap[0][0] <= d.S + 1e-6:
            _, rid = heapq.heappop(heap)
            d.ctx -= inp[rid] + out[rid] / 2
            self.done[rid] = self.t
            self._leave(d, rid, reschedule=False)
        self._reschedule(d)
        self._admit_waiting(d)
        self._maybe_remove(d)

    def _leave(self, d: Replica, rid: int, reschedule: bool = True) -> None:
        d.seats -= 1
        d.kv_free += self.inp[rid] + self.out[rid]
        if self.out[rid] > 1:
            self.win["tpot"].append(((self.t - self.first[rid]) / (self.out[rid] - 1), rid))
        if reschedule:
            self._admit_waiting(d)
            self._maybe_remove(d)

    # ---- the planner ------------------------------------------------------------------------
    @staticmethod
    def _new_window() -> dict:
        return {"arrivals": 0, "in": 0, "out": 0, "ttft": [], "tpot": []}

    def _observation(self) -> Observation:
        c, w, t = self.c, self.win, self.t
        interval = c.planner.interval_s
        p = c.slo.percentile
        ttft = [x for x, rid in w["ttft"] if not self.cold[rid] & 1]
        tpot = [x for x, rid in w["tpot"] if not self.cold[rid] & 2]
        live = [r for r in self.replicas if not r.removed]
        prefill_pool = Pool.COLOCATED if c.mode == "colocated" else Pool.PREFILL
        queues = [r for r in live if r.pool == prefill_pool]
        oldest = min((self.enqueued[r.queue[0][0]] for r in queues if r.queue), default=t)
        n = w["arrivals"]
        return Observation(
            time_s=t,
            window_s=interval,
            arrival_rate=n / interval,
            mean_input_len=w["in"] / n if n else 0.0,
            mean_output_len=w["out"] / n if n else 0.0,
            ttft_ms=float(np.percentile(ttft, p)) * 1e3 if ttft else None,
            tpot_ms=float(np.percentile(tpot, p)) * 1e3 if tpot else None,
            prefill_queue_tokens=sum(r.queued_tokens for r in queues),
            prefill_queue_time_s=t - oldest,
            decode_waiting=len(self.waiting) - self.wait_head,
            decode_running=sum(len(r.heap) for r in live),
            replicas=tuple(
                ReplicaState(r.name, r.pool, max(r.age(t), 0.0), r.draining, r.ready) for r in live
            ),
        )

    def _tick(self) -> None:
        obs = self._observation()
        slo = self.c.slo
        ttft_ok = [x * 1e3 <= slo.ttft_ms for x, _ in self.win["ttft"]]
        tpot_ok = [x * 1e3 <= slo.tpot_ms for x, _ in self.win["tpot"]]
        decisions = self.planner.decide(obs)
        row = {
            "time_s": self.t,
            "arrival_rate": obs.arrival_rate,
            "ttft_ms": obs.ttft_ms,
            "tpot_ms": obs.tpot_ms,
            "ttft_ok": float(np.mean(ttft_ok)) if ttft_ok else math.nan,
            "tpot_ok": float(np.mean(tpot_ok)) if tpot_ok else math.nan,
            "gpus": self.gpus,
            "queue_tokens": obs.prefill_queue_tokens,
            "decode_waiting": obs.decode_waiting,
        }
        for d in decisions:
            row[d.pool] = d.current
            row[f"{d.pool}_target"] = d.target
            if d.target > d.current:
                for _ in range(d.target - d.current):
                    self._add_replica(d.pool, self.t + self.c.startup_s)
            elif d.target < d.current:
                self._drain(d.pool, d.current - d.target)
            if d.direction != "hold":
                self.decisions.append(d)
        self.ticks.append(row)
        self.win = self._new_window()


def simulate(config: SimConfig, workload: Workload, horizon_s: float | None = None) -> SimResult:
    return Simulation(config, workload, horizon_s).run()
