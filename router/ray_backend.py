"""The cluster's Backend: dispatches requests to the prefill and decode actors over Ray.

Per request: pick a decode actor (most free KV, fewest running) and reserve KV there
(before any prefill, so prefill never produces KV that has nowhere to go); pick a prefill
actor (prefix affinity, then least queued tokens); start the prefill, which streams KV to
the reservation; stream the decode actor's tokens back. Tokens come from one long-poll loop
per decode actor that collects every request's new tokens at once, so streaming costs a
Ray call per poll, not per token. Closing a request's generator early cancels it on both
actors (their KV is freed).

Failures do not reach the client while a retry can help: a failed prefill (its actor died,
or the transfer broke) is retried with a fresh reservation; when a decode actor dies, each
of its requests migrates — prompt plus the tokens already streamed are prefilled again and
decoding continues elsewhere, so the client's stream has no duplicated and no missing
tokens. Each attempt uses its own worker-side request id (``id#attempt``), so a late token
from an abandoned attempt can never leak into the stream. After ``max_attempts`` the stream
ends with a clear error.

With SLO targets, admission is SLO-aware (router/admission.py): each decode replica takes
requests only up to an adaptive limit that keeps its TPOT under the target, and a new
request whose forecast TTFT (wait for a slot + the prompt backlog ahead of it) exceeds the
target is refused at once with 429, before it takes any resource. Retries and migrations of
admitted requests bypass both: finishing what was admitted comes first.

In colocated mode the same loop serves ``colocated-<i>`` actors, which run both phases.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import ray

from engine.block_manager import kv_cache_misfit
from engine.errors import InvalidRequestError
from engine.sequence import Fork, TokenLogprobs
from engine.tokenizer import Tokenizer
from kv_transfer.errors import NoCapacityError
from router.admission import (
    DecodeSlotLimit,
    Forecast,
    LineTurnTime,
    RateMeter,
    ReplicaCapacity,
    SLOTargets,
    TTFTForecast,
)
from router.backend import (
    Backend,
    GenerateRequest,
    NoReplica,
    Overloaded,
    RequestRejected,
    TokenDelta,
)
from router.config import RouterLimits
from router.decode_progress import DecodeProgress
from router.load_window import LoadWindow, RequestSample
from router.metrics import RouterMetrics
from router.replicas import Replica, ReplicaSet
from router.timeline import RequestTimeline

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 0.05
LINE_BLOCKED_MEMORY_S = 1.0  # the line counts as blocked this long after a head found no room
# While the line is not blocked, this many at its front reserve side by side (each call
# waits for the decode engine's current step, so one at a time caps the line at about one
# reservation per step); once blocked, only the head retries.
PARALLEL_RESERVATIONS = 8
# With nothing admitted for this long, a request its queues say is fast is let in even if
# the learned forecast error says no: the error is learned only from admitted requests, so
# a stale bad stretch would otherwise refuse everything until it aged out of the window.
PROBE_INTERVAL_S = 0.25
STATS_INTERVAL_S = 0.5


def _logprobs(items: list[dict] | None) -> list[TokenLogprobs] | None:
    if items is None:
        return None
    return [TokenLogprobs(d["token_id"], d["logprob"], d.get("top") or {}) for d in items]


def _is(err: BaseException, kind: type) -> bool:
    """Ray re-raises an actor's exception as a RayTaskError that also subclasses its type."""
    return isinstance(err, kind) or isinstance(getattr(err, "cause", None), kind)


def _message(err: BaseException) -> str:
    text = str(getattr(err, "cause", None) or err).strip()
    return text.splitlines()[-1] if text else type(err).__name__


def _first_logprob(result: dict, index: int) -> dict | None:
    """The first token's logprob of a prefill result's ``index``-th sequence."""
    if index == 0:
        return result.get("logprob")
    return (result.get("fork_logprobs") or [None] * index)[index - 1]


def _prompt_logprobs(items: list[dict | None] | None) -> list[TokenLogprobs | None] | None:
    if items is None:
        return None
    return [None if d is None else _logprobs([d])[0] for d in items]


class _Retry(Exception):
    """This attempt failed in a way another attempt can fix."""


class _AttemptStart:
    """Where an attempt's sequences begin: one decode reservation and one prefill. Shared by
    the sequences of one prompt (OpenAI's n) on their first attempt; of one sequence
    otherwise. ``task`` (reserve, then start the prefill) runs once, for whichever sequence
    asks first; the last sequence to leave cancels what is still running."""

    def __init__(
        self, requests: list[GenerateRequest], worker_rids: list[str], admitted: bool
    ) -> None:
        self.requests = requests
        self.worker_rids = worker_rids
        self.admitted = admitted  # a retry or migration: SLO admission does not refuse it
        self.timeline = RequestTimeline(requests[0].arrival_time)
        self.task: asyncio.Task | None = None  # → the decode replica
        self.prefill_task: asyncio.Task | None = None
        self.prefill_name: str | None = None
        self.backlog = 0  # the prompt's tokens, counted until its first token
        self.members_left = len(requests)
        self.gone: set[int] = set()  # sequences that left before the reservation


@dataclasses.dataclass(eq=False)
class _Place:
    """A request's place in the line for decode capacity."""

    worker_rid: str
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    turn_since: float | None = None  # when it first got to try to reserve


class RayBackend(Backend):
    def __init__(
        self,
        *,
        model_name: str,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int,
        block_size: int,
        colocated: bool = False,
        limits: RouterLimits | None = None,
        slo: SLOTargets | None = None,
        kv_cache_tokens: int | None = None,
    ) -> None:
        """``slo``: the latency targets SLO-aware admission protects; None (or
        ``limits.slo_admission`` false) admits by the static limits alone.
        ``kv_cache_tokens``: a decode replica's KV cache size; a request that can never fit
        it is a 400 at once, before admission (not a 429 under load)."""
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.kv_cache_tokens = kv_cache_tokens
        self.colocated = colocated
        self.decode_pool = "colocated" if colocated else "decode"
        self.limits = limits or RouterLimits()
        self.replicas = ReplicaSet()
        self.load = LoadWindow()
        self._queues: dict[str, asyncio.Queue[dict]] = {}  # worker request id → its deltas
        self._owner: dict[str, str] = {}  # worker request id → decode replica name
        self._pollers: dict[str, asyncio.Task] = {}
        self._stats_task: asyncio.Task | None = None
        self.transfer_bytes_total = 0
        self.transfer_seconds_total = 0.0
        self.retries_total = 0
        self.prefills_total = 0  # prefill calls that succeeded
        self.transfers_total = 0  # and the KV transfers they made
        self.migrations_total = 0
        # Requests waiting for decode capacity, first come first served (retries of admitted
        # requests go to the front). Only its front tries to reserve (the head alone while
        # it finds no capacity); freed capacity wakes it.
        self._line: deque[_Place] = deque()
        self._line_blocked_at = -math.inf  # when its head last found no capacity
        self._line_moved_at = -math.inf  # when a request last left it with a reservation
        self._last_slo_admission = -math.inf
        # SLO-aware admission (None: static limits only).
        self.slo = slo if self.limits.slo_admission else None
        self.slot_limits: dict[str, DecodeSlotLimit] = {}
        self.turn_time = LineTurnTime()
        self.slots_freed = RateMeter()
        self.decode_progress = DecodeProgress()  # when each slot's request should end
        self.capacity = ReplicaCapacity()  # each replica's measured step cost
        self.ttft_forecast = TTFTForecast(
            self.turn_time,
            self.slots_freed,
            self.capacity,
            percentile=self.slo.percentile if self.slo else 90.0,
        )
        # Prompt tokens of admitted attempts still waiting for their first token.
        self.prefill_backlog_tokens = 0
        self.slo_refusals_total = 0

    # ---- replicas (the controller adds, drains and removes them) ------------------------
    def add_replica(self, name: str, pool: str, handle: Any) -> None:
        self.replicas.add(name, pool, handle)
        if pool == self.decode_pool:
            if self.slo is not None:
                self.slot_limits[name] = DecodeSlotLimit(self.slo.tpot_s)
            old = self._pollers.pop(name, None)
            if old is not None:
                old.cancel()
            self._pollers[name] = asyncio.create_task(self._poll_loop(name))

    def drain_replica(self, name: str) -> None:
        replica = self.replicas.by_name.get(name)
        if replica is not None:
            replica.draining = True

    def remove_replica(self, name: str) -> None:
        """Forget an actor (drained, or dead); requests still on it are retried elsewhere."""
        replica = self.replicas.remove(name)
        self.slot_limits.pop(name, None)
        self.capacity.forget(name)
        task = self._pollers.pop(name, None)
        if task is not None:
            task.cancel()
        if replica is not None:
            self._retry_requests_of(name, f"{name} was removed")

    async def start(self) -> None:
        await self._refresh_stats()
        self._stats_task = asyncio.create_task(self._stats_loop())

    async def stop(self) -> None:
        tasks = [*self._pollers.values(), *([self._stats_task] if self._stats_task else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ---- Backend ------------------------------------------------------------------------
    def generate_forks(self, requests: list[GenerateRequest]) -> list[AsyncIterator[TokenDelta]]:
        """The sequences of one prompt: their first attempt is one reservation (on one decode
        replica) and one prefill and transfer; each then streams, and is retried or migrated,
        on its own."""
        start = _AttemptStart(requests, [f"{r.request_id}#0" for r in requests], admitted=False)
        return [self.generate(r, start, index) for index, r in enumerate(requests)]

    async def generate(
        self, request: GenerateRequest, first: _AttemptStart | None = None, index: int = 0
    ) -> AsyncIterator[TokenDelta]:
        """``first``: the first attempt's start when it is shared with other sequences of
        the prompt (``generate_forks``), ``request`` being its ``index``-th."""
        self.load.arrived(request.arrival_time)
        streamed: list[int] = []  # tokens the client has received
        served_by: set[str] = set()
        first_token_at: float | None = None
        finish_reason: str | None = None
        attempt = 0
        last_error = ""
        try:
            while True:
                if attempt >= self.limits.max_attempts:
                    finish_reason = "error"
                    yield TokenDelta(
                        [],
                        finish_reason="error",
                        error=f"request failed after {attempt} attempts: {last_error}",
                    )
                    return
                sub = self._attempt_request(request, streamed)
                worker_rid = f"{request.request_id}#{attempt}"
                # A pool may be empty for a moment while the controller replaces a replica.
                await self._await_replicas(
                    self.limits.queue_timeout_s if attempt > 0 else self.limits.replica_wait_s
                )
                attempt += 1
                if attempt == 1 and first is not None:
                    start, member = first, index
                else:
                    start, member = _AttemptStart([sub], [worker_rid], admitted=attempt > 1), 0
                deltas = self._run_attempt(start, member, served_by)
                try:
                    async for delta in deltas:
                        if delta.token_ids and first_token_at is None:
                            first_token_at = time.monotonic()
                        streamed.extend(delta.token_ids)
                        finish_reason = delta.finish_reason
                        yield delta
                        if finish_reason is not None:
                            return
                except _Retry as retry:
                    last_error = str(retry)
                    if streamed:
                        self.migrations_total += 1
                    else:
                        self.retries_total += 1
                    logger.warning(
                        "request %s: attempt %d failed (%s); retrying",
                        request.request_id,
                        attempt,
                        retry,
                    )
                    continue
                except (Overloaded, NoReplica, RequestRejected):
                    if not streamed and attempt == 1:
                        raise  # before the first token: the API answers 429 / 503 / 400
                    finish_reason = "error"
                    yield TokenDelta(
                        [], finish_reason="error", error=f"no replica to continue on: {last_error}"
                    )
                    return
                finally:
                    # Its cleanup (cancel on the workers, free the queue) runs now, not at GC.
                    await deltas.aclose()
        finally:
            now = time.monotonic()
            tpot = None
            if first_token_at is not None and len(streamed) > 1:
                tpot = (now - first_token_at) / (len(streamed) - 1)
            self.load.finished(
                RequestSample(
                    arrival=request.arrival_time,
                    input_len=len(request.prompt_token_ids),
                    output_len=len(streamed),
                    ttft_s=None
                    if first_token_at is None
                    else first_token_at - request.arrival_time,
                    tpot_s=tpot,
                    ok=finish_reason in ("stop", "length"),
                    replicas=tuple(served_by),
                )
            )

    async def _await_replicas(self, timeout_s: float) -> None:
        """Before a retry: wait (bounded) until both pools have a routable replica again,
        e.g. while the controller replaces the one that died."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            decode_ok = bool(self.replicas.decode_candidates(self.decode_pool, set()))
            prefill_ok = self.colocated or any(r.routable for r in self.replicas.pool("prefill"))
            if decode_ok and prefill_ok:
                return
            await asyncio.sleep(0.1)

    def _attempt_request(self, request: GenerateRequest, streamed: list[int]) -> GenerateRequest:
        """The request for the next attempt: after a migration, the tokens already streamed
        become part of the prompt and the budget shrinks by as many."""
        if not streamed:
            return request
        params = dataclasses.replace(
            request.params,
            max_tokens=request.params.max_tokens - len(streamed),
            min_tokens=max(0, request.params.min_tokens - len(streamed)),
        )
        return dataclasses.replace(
            request, prompt_token_ids=[*request.prompt_token_ids, *streamed], params=params
        )

    async def _run_attempt(
        self, start: _AttemptStart, index: int, served_by: set[str]
    ) -> AsyncIterator[TokenDelta]:
        """One attempt of the ``index``-th sequence of ``start``: once the start has its
        reservation (and prefill under way), this sequence's tokens as they arrive."""
        request, worker_rid = start.requests[index], start.worker_rids[index]
        queue: asyncio.Queue[dict] = asyncio.Queue()
        self._queues[worker_rid] = queue
        decode: Replica | None = None
        finished = False
        last_delivery: float | None = None
        timeline = start.timeline
        # The first token reaches the router twice in disaggregated mode: with the prefill
        # call's result (sent on at once) and at the head of the decode replica's stream.
        first_sent = False
        skip_decode_first = False
        try:
            if start.task is None:
                start.task = asyncio.create_task(self._begin(start))
            decode = await asyncio.shield(start.task)
            served_by.add(decode.name)
            self.decode_progress.start(worker_rid, decode.name, request.params.max_tokens)
            slot_limit = self.slot_limits.get(decode.name)
            first_delta = True
            wants_prefill_result = (
                request.params.logprobs is not None or request.params.prompt_logprobs is not None
            )
            while True:
                try:
                    delta = await asyncio.wait_for(queue.get(), timeout=self.limits.idle_timeout_s)
                except asyncio.TimeoutError:
                    raise _Retry(
                        f"no token from {decode.name} for {self.limits.idle_timeout_s:.0f}s"
                    ) from None
                if "retry" in delta:
                    raise _Retry(delta["retry"])
                if "first_token" in delta:  # the prefill's result
                    if first_sent:
                        continue  # the decode replica's stream was quicker
                    first_sent = skip_decode_first = True
                    lp = delta.get("logprob")
                    delta = {
                        "token_ids": [delta["first_token"]],
                        "logprobs": None if lp is None else [lp],
                        "prompt_logprobs": delta.get("prompt_logprobs"),
                        "finish_reason": None,
                        "error": None,
                    }
                    first_delta = False
                elif skip_decode_first and delta["token_ids"]:
                    # Already sent; the decode stream has no logprob for it (it was sampled on
                    # the prefill replica), so only the token goes.
                    skip_decode_first = False
                    delta = {**delta, "token_ids": delta["token_ids"][1:]}
                    if not delta["token_ids"] and delta["finish_reason"] is None:
                        continue
                if first_delta and wants_prefill_result and start.prefill_task is not None:
                    # The first token was sampled on the prefill actor, which has its logprobs
                    # (and the prompt's).
                    result = await asyncio.shield(start.prefill_task)
                    if result and delta["token_ids"]:
                        lp = _first_logprob(result, index)
                        if lp is not None:
                            delta["logprobs"] = [lp, *(delta["logprobs"] or [])]
                        delta["prompt_logprobs"] = result.get("prompt_logprobs")
                first_delta = False
                first_sent = first_sent or bool(delta["token_ids"])
                now = time.monotonic()
                if delta["token_ids"] and start.backlog:  # the prompt's first token
                    self.prefill_backlog_tokens -= start.backlog
                    start.backlog = 0
                if delta["token_ids"] and timeline.first_token is None:  # the prompt's first
                    error_s = self.ttft_forecast.first_token(start.worker_rids[0], now)
                    if error_s is not None:
                        RouterMetrics.of(self).ttft_forecast_error.observe(error_s)
                    timeline.first_token = now
                self.decode_progress.delivered(worker_rid, now, len(delta["token_ids"]))
                if slot_limit is not None and last_delivery is not None:
                    slot_limit.observe(now, now - last_delivery, len(delta["token_ids"]))
                last_delivery = now
                finishing = delta["finish_reason"] is not None
                out = TokenDelta(
                    token_ids=delta["token_ids"],
                    logprobs=_logprobs(delta["logprobs"]),
                    finish_reason=delta["finish_reason"],
                    error=delta["error"],
                    # by the end the prefill's own account is in, whichever path came first
                    timings=timeline.stages() if finishing and timeline.first_token else None,
                    prompt_logprobs=_prompt_logprobs(delta.get("prompt_logprobs")),
                )
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(worker_rid, None)
            self._owner.pop(worker_rid, None)
            self.ttft_forecast.forget(worker_rid)
            self.decode_progress.end(worker_rid)
            if start.prefill_name:
                served_by.add(start.prefill_name)
            task = start.task
            if decode is None and task is not None and task.done() and not task.cancelled():
                if task.exception() is None:  # reserved, but this sequence left before it knew
                    decode = task.result()
            if decode is not None:
                self._release_slot(decode, worker_rid, cancel=not finished)
            else:
                start.gone.add(index)  # the start, if it reserves, releases its slot
            start.members_left -= 1
            if start.members_left == 0:
                self.prefill_backlog_tokens -= start.backlog
                start.backlog = 0
                for task in (start.task, start.prefill_task):
                    if task is not None and not task.done():
                        task.cancel()

    async def _begin(self, start: _AttemptStart) -> Replica:
        """Reserve decode capacity for every sequence of ``start`` and start its prefill."""
        head, rid = start.requests[0], start.worker_rids[0]
        forks = tuple(
            Fork(r, req.params)
            for r, req in zip(start.worker_rids[1:], start.requests[1:], strict=True)
        )
        decode, reservation = await self._reserve(head, rid, start.admitted, start.timeline, forks)
        for index in start.gone:  # left while it reserved
            self._release_slot(decode, start.worker_rids[index], cancel=True)
        start.backlog = len(head.prompt_token_ids)
        self.prefill_backlog_tokens += start.backlog
        if not self.colocated:
            start.prefill_task = asyncio.create_task(self._prefill(start, decode, reservation))
        return decode

    def _release_slot(self, decode: Replica, worker_rid: str, cancel: bool) -> None:
        """A sequence is done with its slot on ``decode`` (cancelled there if unfinished)."""
        decode.in_flight -= 1
        self._owner.pop(worker_rid, None)
        self.slots_freed.add(time.monotonic())
        self._wake_front_of_line()
        if cancel and decode.alive:
            decode.handle.cancel.remote(worker_rid)

    async def health(self) -> dict[str, Any]:
        decode_ready = sum(r.routable for r in self.replicas.pool(self.decode_pool))
        prefill_ready = sum(r.routable for r in self.replicas.pool("prefill"))
        ok = decode_ready > 0 and (self.colocated or prefill_ready > 0)
        return {
            "status": "ok" if ok else "degraded",
            "mode": "colocated" if self.colocated else "disaggregated",
            "prefill": prefill_ready,
            "decode": decode_ready,
        }

    def stats(self) -> dict[str, Any]:
        replicas = list(self.replicas.by_name.values())
        return {
            "queue_tokens": {r.name: r.stats.get("queued_tokens", 0) for r in replicas},
            "running": {r.name: r.stats.get("running", 0) for r in replicas},
            "kv_usage": {r.name: r.stats.get("kv_usage", 0.0) for r in replicas},
            "transfer_bytes_total": self.transfer_bytes_total,
            "transfer_seconds_total": self.transfer_seconds_total,
            "router_waiting": self.waiting,
            "router_waiting_for_capacity": self.waiting_for_capacity,
            "retries_total": self.retries_total,
            "prefills_total": self.prefills_total,
            "transfers_total": self.transfers_total,
            "migrations_total": self.migrations_total,
            "slot_limit": {name: limit.limit for name, limit in self.slot_limits.items()},
            "slo_refusals_total": self.slo_refusals_total,
            "prefill_backlog_tokens": self.prefill_backlog_tokens,
        }

    def replica_stats(self) -> dict[str, dict]:
        return self.replicas.summary()

    @property
    def waiting(self) -> int:
        """Requests in line for decode capacity."""
        return len(self._line)

    @property
    def waiting_for_capacity(self) -> int:
        """Requests in line while the line is blocked lately (its head found no decode
        capacity): a full decode pool. Requests merely queued behind a reservation call in
        flight do not count."""
        return self.waiting if self._line_blocked else 0

    @property
    def _line_blocked(self) -> bool:
        """Whether the line's head found no decode capacity within LINE_BLOCKED_MEMORY_S."""
        return time.monotonic() - self._line_blocked_at < LINE_BLOCKED_MEMORY_S

    # ---- admission and dispatch -----------------------------------------------------------
    async def _reserve(
        self,
        request: GenerateRequest,
        worker_rid: str,
        admitted: bool,
        timeline: RequestTimeline,
        forks: tuple[Fork, ...] = (),
    ) -> tuple[Replica, dict]:
        """Admission, then a place in the line until a decode replica reserves KV for the
        request (and slots for its ``forks``)."""
        limits = self.limits
        slo = None if admitted else self.slo
        self._check_fits_kv_cache(request)
        if not self.replicas.decode_candidates(self.decode_pool, set()):
            raise NoReplica(f"no {self.decode_pool} replica is ready")
        if not self.colocated:
            if (
                self.replicas.prefill_choice(request.prompt_token_ids, self.block_size, set())
                is None
            ):
                raise NoReplica("no prefill replica is ready")
            queued = sum(r.stats.get("queued_tokens", 0) for r in self.replicas.pool("prefill"))
            if queued + len(request.prompt_token_ids) > limits.max_prefill_queue_tokens:
                raise Overloaded(
                    f"{queued} prompt tokens are already queued for prefill", retry_after_s=1.0
                )
        if self.waiting >= limits.max_waiting:
            raise Overloaded(
                f"{self.waiting} requests are already waiting for KV capacity", retry_after_s=1.0
            )
        if slo is not None:
            forecast = self._refuse_if_ttft_forecast_misses(request, slo, 1 + len(forks))
            if forecast.informed:  # its error is worth learning from
                self.ttft_forecast.admitted(worker_rid, request.arrival_time, forecast.raw_s)
        deadline = time.monotonic() + limits.queue_timeout_s
        place = _Place(worker_rid)
        if admitted:
            self._line.appendleft(place)
        else:
            self._line.append(place)
        try:
            while True:
                if place in itertools.islice(self._line, self._reserving_now()):
                    if place.turn_since is None:
                        place.turn_since = time.monotonic()
                    place.wake.clear()
                    if timeline.reserve_started is None:
                        timeline.reserve_started = time.monotonic()
                    reserved = await self._try_reserve(request, worker_rid, slo is not None, forks)
                    if reserved is None:
                        self._line_blocked_at = time.monotonic()
                    if reserved is not None:
                        timeline.reserved = time.monotonic()
                        self._line_moved(place)
                        return reserved
                if time.monotonic() > deadline:
                    if place.turn_since is not None:  # its turn counts too
                        self._line_moved(place)
                    raise Overloaded(
                        f"no {self.decode_pool} replica had capacity within "
                        f"{limits.queue_timeout_s:.0f}s",
                        retry_after_s=1.0,
                    )
                # Wait for a request to finish somewhere or to reach the front (or re-check
                # shortly: KV also frees on the workers' own account).
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(place.wake.wait(), timeout=0.05)
        finally:
            self._line.remove(place)
            self._wake_front_of_line()

    def _check_fits_kv_cache(self, request: GenerateRequest) -> None:
        """The decode worker's own check, made here first so that load cannot turn a request
        that can never be served into a 429."""
        if self.kv_cache_tokens is None:
            return
        misfit = kv_cache_misfit(
            len(request.prompt_token_ids),
            request.params.max_tokens,
            self.max_model_len,
            self.block_size,
            self.kv_cache_tokens // self.block_size,
        )
        if misfit is not None:
            raise RequestRejected(misfit)

    def _reserving_now(self) -> int:
        """How many at the front of the line may try to reserve now."""
        return 1 if self._line_blocked else PARALLEL_RESERVATIONS

    def _wake_front_of_line(self) -> None:
        for place in itertools.islice(self._line, self._reserving_now()):
            place.wake.set()

    def _line_moved(self, place: _Place) -> None:
        """``place`` leaves the line after its turn: since the line last moved, or since it
        got to try if that was later."""
        now = time.monotonic()
        self.turn_time.departed(now, now - max(self._line_moved_at, place.turn_since or now))
        self._line_moved_at = now

    def _current_turn_s(self) -> float:
        """How long the line has not moved while its front tries (0 with no line)."""
        started = [p.turn_since for p in self._line if p.turn_since is not None]
        if not started:
            return 0.0
        now = time.monotonic()
        return now - max(self._line_moved_at, min(started))

    @property
    def _prefill_pool(self) -> str:
        """The pool that computes prompts (in colocated mode, the one pool)."""
        return "colocated" if self.colocated else "prefill"

    def _free_slots(self, replica: Replica) -> float:
        """How many more requests ``replica`` takes under its SLO slot limit (any number
        without one)."""
        limit = self.slot_limits.get(replica.name)
        return math.inf if limit is None else max(0, limit.limit - replica.in_flight)

    def _has_slots(self, replica: Replica, width: int) -> bool:
        """Whether ``replica``'s SLO slot limit lets ``width`` more sequences in (an idle
        replica takes any one request, however wide)."""
        return self._free_slots(replica) >= width or replica.in_flight == 0

    def _refuse_if_ttft_forecast_misses(
        self, request: GenerateRequest, slo: SLOTargets, width: int = 1
    ) -> Forecast:
        """Early rejection: 429 now for a request (of ``width`` sequences) that would miss
        its TTFT target."""
        candidates = self.replicas.decode_candidates(self.decode_pool, set())
        started = time.monotonic()
        forecast = self.ttft_forecast.forecast(
            started,
            waiting=self.waiting,
            current_turn_s=self._current_turn_s(),
            free_slots=sum(self._free_slots(r) for r in candidates),
            prefill_backlog_tokens=self.prefill_backlog_tokens,
            prompt_tokens=len(request.prompt_token_ids),
            prefill_replicas=[r.name for r in self.replicas.pool(self._prefill_pool)],
            slot_ends_s=self.decode_progress.slot_ends_s({r.name for r in candidates}, started),
            slots_needed=width,
        )
        now = time.monotonic()
        limit_s = slo.ttft_limit_s(forecast.own_prefill_s)
        probe = forecast.raw_s <= limit_s and now - self._last_slo_admission >= PROBE_INTERVAL_S
        # Nothing ahead of it (no prompt still waiting for its first token, no line, a slot
        # free): its forecast is its own prefill, which refusing it would not make shorter.
        idle = (
            self.prefill_backlog_tokens == 0
            and self.waiting == 0
            and candidates
            and not math.isinf(forecast.slot_wait_s)
            and any(self._has_slots(r, width) for r in candidates)
        )
        if forecast.ttft_s > limit_s and not probe and not idle:
            self.slo_refusals_total += 1
            if math.isinf(forecast.prefill_s):
                raise Overloaded(
                    f"{self.prefill_backlog_tokens} prompt tokens are waiting for their first "
                    "token and the prefill speed is not measured yet (the cluster is starting)",
                    retry_after_s=1.0,
                )
            # Come back when the excess wait has passed (unknown: soon; never minutes).
            if math.isinf(forecast.slot_wait_s):
                raise Overloaded(
                    f"every {self.decode_pool} replica is at the load its TPOT target "
                    f"(at least {slo.tpot_ms:.0f} ms) allows and none has freed a slot lately",
                    retry_after_s=1.0,
                )
            excess_s = forecast.ttft_s - limit_s
            raise Overloaded(
                f"forecast time to first token {forecast.ttft_s * 1000:.0f} ms "
                f"(waiting for decode {forecast.slot_wait_s * 1000:.0f} ms, prefill "
                f"{forecast.prefill_s * 1000:.0f} ms, recent forecast error "
                f"{forecast.error_s * 1000:.0f} ms) is past the {limit_s * 1000:.0f} ms "
                f"admission allows under the {slo.ttft_ms:.0f} ms TTFT target",
                retry_after_s=min(10.0, max(1.0, math.ceil(excess_s))),
            )
        self._last_slo_admission = now
        return forecast

    async def _try_reserve(
        self,
        request: GenerateRequest,
        worker_rid: str,
        within_slots: bool,
        forks: tuple[Fork, ...] = (),
    ) -> tuple[Replica, dict] | None:
        """Reserve on the first replica with capacity (and, ``within_slots``, under its
        SLO slot limit); None if all are full right now. The request and its forks count a
        slot each."""
        candidates = self.replicas.decode_candidates(self.decode_pool, set())
        if not candidates:
            raise NoReplica(f"no {self.decode_pool} replica is ready")
        if within_slots:
            candidates = [r for r in candidates if self._has_slots(r, 1 + len(forks))]
        for replica in candidates:
            # Counted from now, so that reservations made side by side respect the limit.
            width = 1 + len(forks)
            replica.in_flight += width
            try:
                if self.colocated:
                    await replica.handle.submit.remote(
                        worker_rid, request.prompt_token_ids, request.params, forks
                    )
                    reservation: dict = {}
                else:
                    reservation = await replica.handle.reserve.remote(
                        worker_rid, request.prompt_token_ids, request.params, forks
                    )
            except BaseException as err:  # noqa: BLE001 - sorted by kind below
                replica.in_flight -= width
                if not isinstance(err, Exception):
                    raise  # cancelled: the client went away
                if _is(err, NoCapacityError):
                    if replica.name in self.slot_limits:
                        self.slot_limits[replica.name].full_at(replica.in_flight)
                    continue
                if _is(err, InvalidRequestError):
                    raise RequestRejected(_message(err)) from None
                if isinstance(err, ray.exceptions.RayActorError):
                    replica.alive = False
                    continue
                raise
            for rid in (worker_rid, *(f.request_id for f in forks)):
                self._owner[rid] = replica.name
            return replica, reservation
        return None

    async def _prefill(
        self, start: _AttemptStart, decode: Replica, reservation: dict
    ) -> dict | None:
        """Run the prefill (one for all of ``start``'s sequences). On failure, each of them
        is retried (a fresh reservation, another prefill replica if this one died)."""
        request, rids, timeline = start.requests[0], start.worker_rids, start.timeline
        replica = self.replicas.prefill_choice(request.prompt_token_ids, self.block_size, set())
        if replica is None:
            self._signal_all(rids, {"retry": "no prefill replica is ready"})
            return None
        start.prefill_name = replica.name
        replica.in_flight += 1
        timeline.prefill_sent = time.monotonic()
        forks = tuple(Fork(r, q.params) for r, q in zip(rids[1:], start.requests[1:], strict=True))
        try:
            result = await replica.handle.prefill.remote(
                rids[0],
                request.prompt_token_ids,
                request.params,
                reservation["kv_address"],
                reservation["lease_id"],
                forks=forks,
            )
        except asyncio.CancelledError:
            replica.handle.cancel.remote(rids[0])
            raise
        except Exception as err:  # noqa: BLE001 - any failure ends this attempt cleanly
            if isinstance(err, ray.exceptions.RayActorError):
                replica.alive = False
            self._signal_all(rids, {"retry": f"prefill on {replica.name} failed: {_message(err)}"})
            return None
        finally:
            replica.in_flight -= 1
        timeline.prefill_returned = time.monotonic()
        timeline.worker = {
            key: float(result.get(key, 0.0)) for key in ("wait_s", "compute_s", "transfer_finish_s")
        }
        tokens = [result["first_token"], *result.get("fork_tokens", ())]
        for index, rid in enumerate(rids):
            self._signal(
                rid,
                {
                    "first_token": tokens[index],
                    "logprob": _first_logprob(result, index),
                    "prompt_logprobs": result.get("prompt_logprobs"),
                },
            )
        transfer = result.get("transfer") or {}
        self.transfer_bytes_total += int(transfer.get("payload_bytes", 0) or 0)
        self.transfer_seconds_total += float(transfer.get("seconds", 0.0) or 0.0)
        self.prefills_total += 1
        self.transfers_total += 1 if transfer else 0
        return result

    def _signal_all(self, worker_rids: list[str], delta: dict) -> None:
        for rid in worker_rids:
            self._signal(rid, delta)

    def _signal(self, worker_rid: str, delta: dict) -> None:
        queue = self._queues.get(worker_rid)
        if queue is not None:
            queue.put_nowait(delta)

    # ---- background loops -------------------------------------------------------------------
    async def _poll_loop(self, name: str) -> None:
        while True:
            replica = self.replicas.by_name.get(name)
            if replica is None:
                return
            try:
                batches = await replica.handle.poll.remote(POLL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - the actor died or is unreachable
                logger.warning("polling %s failed: %s", name, _message(err))
                replica.alive = False
                self._retry_requests_of(name, f"{name} is unavailable ({type(err).__name__})")
                await asyncio.sleep(1.0)
                continue
            replica.alive = True
            for worker_rid, delta in batches.items():
                self._signal(worker_rid, delta)

    def _retry_requests_of(self, name: str, reason: str) -> None:
        for worker_rid, owner in list(self._owner.items()):
            if owner == name:
                self._signal(worker_rid, {"retry": reason})

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            await self._refresh_stats()

    async def _refresh_stats(self) -> None:
        replicas = list(self.replicas.by_name.values())
        results = await asyncio.gather(
            *(r.handle.stats.remote() for r in replicas), return_exceptions=True
        )
        now = time.time()
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, BaseException):
                replica.alive = False
            else:
                replica.stats = {**result, "refreshed_at": now}
                replica.alive = True
                self._update_admission(replica)

    def _update_admission(self, replica: Replica) -> None:
        """Feed a replica's fresh stats to SLO-aware admission."""
        if self.slo is None:
            return
        self.capacity.update(replica.name, replica.stats.get("step_cost"))
        limit = self.slot_limits.get(replica.name)
        if limit is not None:
            limit.update(
                time.monotonic(),
                replica.in_flight,
                floor=self.capacity.free_batch(replica.name),
                target_s=self.slo.tpot_target_s(self.capacity.step_alone_s(replica.name)),
            )
