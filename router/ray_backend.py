"""The cluster's Backend: dispatches requests to the prefill and decode actors over Ray.

A request's life (docs/structure.md has it step by step):

1. **admit** — static limits, then SLO-aware admission (router/slo_admission.py): 429 now
   for a request that would miss its TTFT target, before it takes any resource;
2. **reserve** — a place in the line for decode capacity (router/decode_line.py) until a
   decode actor (most free KV, fewest running) reserves KV for the prompt, before any
   prefill, so prefill never produces KV that has nowhere to go;
3. **prefill** — a prefill actor (the cheapest: prompt tokens not in its prefix cache, by the
   router's index of the replicas' KV events, plus its backlog; router/prefill_routing.py)
   computes the prompt and streams its KV into the reservation (router/dispatch.py: in colocated mode
   one actor does both);
4. **stream** — the decode actor's tokens, collected for every request at once by one
   long-poll loop per actor (router/token_streams.py);
5. **finish or retry** — router/attempt.py runs steps 2–4 as one attempt; one that fails
   (its actor died, the transfer broke) is retried with a fresh reservation, and a request
   whose decode actor died migrates: prompt plus the tokens already streamed are prefilled
   again and decoding continues elsewhere, with no duplicated and no missing tokens. Each
   attempt has its own worker-side request id (``id#attempt``), so a late token from an
   abandoned attempt never leaks into the stream. After ``max_attempts`` the stream ends
   with a clear error. Retries and migrations skip SLO admission: finishing what was
   admitted comes first.

Closing a request's generator early cancels it on both actors (their KV is freed). The n
choices of one prompt (``generate_forks``) share their first attempt's reservation and
prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from engine.tokenizer import Tokenizer
from router.admission import SLOTargets
from router.attempt import AttemptFailed, Attempts, AttemptStart
from router.backend import (
    Backend,
    GenerateRequest,
    NoReplica,
    Overloaded,
    RequestRejected,
    TokenDelta,
)
from router.config import RouterLimits, RoutingConfig
from router.decode_line import DecodeLine
from router.dispatch import Colocated, Disaggregated
from router.kv_index import KVIndex
from router.load_window import LoadWindow, RequestSample
from router.metrics import RouterMetrics
from router.prefill_routing import PrefillPolicy
from router.replicas import ReplicaSet, ReplicaView
from router.slo_admission import SLOAdmission
from router.token_streams import TokenStreams
from workers.pool import Pool

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5


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
        routing: RoutingConfig | None = None,
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
        self.colocated = colocated
        self.limits = limits or RouterLimits()
        self.routing = routing or RoutingConfig()
        self.dispatch = (
            Colocated() if colocated else Disaggregated(self.routing.local_prefill_limit)
        )
        self.decode_pool = self.dispatch.decode_pool
        self.replicas = ReplicaSet()
        self.kv_index = KVIndex()
        self.load = LoadWindow()
        self.streams = TokenStreams(self.replicas)
        self.line = DecodeLine()
        self.admission = SLOAdmission(slo if self.limits.slo_admission else None, self.line)
        self.attempts = Attempts(
            replicas=self.replicas,
            streams=self.streams,
            admission=self.admission,
            line=self.line,
            dispatch=self.dispatch,
            limits=self.limits,
            block_size=block_size,
            max_model_len=max_model_len,
            kv_cache_tokens=kv_cache_tokens,
            on_forecast_error=lambda s: RouterMetrics.of(self).ttft_forecast_error.observe(s),
            kv_index=self.kv_index,
            prefill_policy=PrefillPolicy(self.routing.prefill),
        )
        self._stats_task: asyncio.Task | None = None
        self.retries_total = 0
        self.migrations_total = 0

    # ---- replicas (the controller adds, drains and removes them) ------------------------
    def add_replica(self, name: str, pool: Pool | str, handle: Any) -> None:
        pool = Pool(pool)
        self.replicas.add(name, pool, handle)
        if pool == self.decode_pool:
            self.admission.decode_replica_added(name)
            self.streams.start_polling(name)

    def drain_replica(self, name: str) -> None:
        replica = self.replicas.by_name.get(name)
        if replica is not None:
            replica.draining = True
        self.kv_index.drop(name)  # routed nowhere now: its prefixes go where they are cheapest

    def remove_replica(self, name: str) -> None:
        """Forget an actor (drained, or dead); requests still on it are retried elsewhere."""
        replica = self.replicas.remove(name)
        self.kv_index.drop(name)
        self.admission.replica_removed(name)
        self.streams.stop_polling(name)
        if replica is not None:
            self.streams.retry_all_on(name, f"{name} was removed")

    async def start(self) -> None:
        await self._refresh_stats()
        self._stats_task = asyncio.create_task(self._stats_loop())

    async def stop(self) -> None:
        tasks = [*self.streams.pollers(), *([self._stats_task] if self._stats_task else [])]
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
        start = AttemptStart(requests, [f"{r.request_id}#0" for r in requests], admitted=False)
        return [self.generate(r, start, index) for index, r in enumerate(requests)]

    async def generate(
        self, request: GenerateRequest, first: AttemptStart | None = None, index: int = 0
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
                # A pool may be empty while the controller replaces a replica. A stream that
                # has tokens waits for it as long as a stream may stay silent: its node may be
                # gone, and a replacement takes a placement and a model load.
                await self._await_replicas(
                    self.limits.replica_wait_s
                    if attempt == 0
                    else self.limits.idle_timeout_s
                    if streamed
                    else self.limits.queue_timeout_s
                )
                if attempt == 0 and first is not None:
                    start, member = first, index
                else:
                    sub = _attempt_request(request, streamed)
                    rid = f"{request.request_id}#{attempt}"
                    start, member = AttemptStart([sub], [rid], admitted=attempt > 0), 0
                attempt += 1
                deltas = self.attempts.run(start, member, served_by)
                try:
                    async for delta in deltas:
                        if delta.token_ids and first_token_at is None:
                            first_token_at = time.monotonic()
                        streamed.extend(delta.token_ids)
                        finish_reason = delta.finish_reason
                        yield delta
                        if finish_reason is not None:
                            return
                except AttemptFailed as failure:
                    last_error = str(failure)
                    if streamed:
                        self.migrations_total += 1
                    else:
                        self.retries_total += 1
                    logger.warning(
                        "request %s: attempt %d failed (%s); retrying",
                        request.request_id,
                        attempt,
                        failure,
                    )
                    continue
                except (Overloaded, NoReplica, RequestRejected) as err:
                    if not streamed:  # before the first token: the API answers 429 / 503 / 400
                        if attempt == 1:
                            raise
                        err.args = (f"{err} (the earlier attempt failed: {last_error})",)
                        raise
                    finish_reason = "error"
                    yield TokenDelta(
                        [], finish_reason="error", error=f"no replica to continue on: {last_error}"
                    )
                    return
                finally:
                    # Its cleanup (cancel on the workers, free the queue) runs now, not at GC.
                    await deltas.aclose()
        finally:
            self._record(request, streamed, first_token_at, finish_reason, served_by)

    def _record(self, request, streamed, first_token_at, finish_reason, served_by) -> None:
        """The finished request, for the planner's load window."""
        now = time.monotonic()
        tpot = None
        if first_token_at is not None and len(streamed) > 1:
            tpot = (now - first_token_at) / (len(streamed) - 1)
        self.load.finished(
            RequestSample(
                arrival=request.arrival_time,
                input_len=len(request.prompt_token_ids),
                output_len=len(streamed),
                ttft_s=None if first_token_at is None else first_token_at - request.arrival_time,
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
            prefill_ok = not self.dispatch.has_prefill_pool or any(
                r.routable for r in self.replicas.pool(Pool.PREFILL)
            )
            if decode_ok and prefill_ok:
                return
            await asyncio.sleep(0.1)

    async def health(self) -> dict[str, Any]:
        decode_ready = sum(r.routable for r in self.replicas.pool(self.decode_pool))
        prefill_ready = sum(r.routable for r in self.replicas.pool(Pool.PREFILL))
        ok = decode_ready > 0 and (not self.dispatch.has_prefill_pool or prefill_ready > 0)
        return {
            "status": "ok" if ok else "degraded",
            "mode": "colocated" if self.colocated else "disaggregated",
            "prefill": prefill_ready,
            "decode": decode_ready,
        }

    def stats(self) -> dict[str, Any]:
        replicas = list(self.replicas.by_name.values())
        counters = self.attempts.counters
        return {
            "queue_tokens": {r.name: r.stats.load.queued_tokens for r in replicas},
            "running": {r.name: r.stats.load.running for r in replicas},
            "kv_usage": {r.name: r.stats.load.kv_usage for r in replicas},
            "kv_index_blocks": {r.name: self.kv_index.blocks(r.name) for r in replicas},
            "prefix_cache_queries": {r.name: r.stats.load.prefix_query_tokens for r in replicas},
            "prefix_cache_hits": {r.name: r.stats.load.prefix_hit_tokens for r in replicas},
            "prefill_routing": dict(self.attempts.routing_decisions),
            "prefill_path": dict(self.attempts.prefill_paths),
            "decode_reused_tokens_total": self.attempts.decode_reused_tokens,
            "transfer_bytes_total": counters.transfer_bytes,
            "transfer_seconds_total": counters.transfer_seconds,
            "prefills_total": counters.prefills,
            "transfers_total": counters.transfers,
            "transport_transfers": {t: c.transfers for t, c in counters.by_transport.items()},
            "transport_bytes": {t: c.bytes for t, c in counters.by_transport.items()},
            "transport_seconds": {t: c.seconds for t, c in counters.by_transport.items()},
            "router_waiting": self.line.waiting,
            "router_waiting_for_capacity": self.line.waiting_for_capacity,
            "retries_total": self.retries_total,
            "migrations_total": self.migrations_total,
            "slot_limit": {name: limit.limit for name, limit in self.admission.slot_limits.items()},
            "slo_refusals_total": self.admission.refusals_total,
            "prefill_backlog_tokens": self.admission.prefill_backlog_tokens,
        }

    def replica_stats(self) -> dict[str, ReplicaView]:
        return self.replicas.summary()

    @property
    def waiting(self) -> int:
        """Requests in line for decode capacity."""
        return self.line.waiting

    @property
    def waiting_for_capacity(self) -> int:
        """Requests in line while it is blocked: a full decode pool (the planner's signal)."""
        return self.line.waiting_for_capacity

    # ---- background: replica stats --------------------------------------------------------
    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            await self._refresh_stats()

    async def _refresh_stats(self) -> None:
        """Every replica's stats, and what its prefix cache stored and removed since the
        index's last read (a draining replica's cache is not routed to: not read)."""
        replicas = list(self.replicas.by_name.values())
        indexed = [r for r in replicas if not r.draining]
        results = await asyncio.gather(
            *(r.handle.stats.remote() for r in replicas),
            *(r.handle.kv_events.remote(self.kv_index.cursor(r.name)) for r in indexed),
            return_exceptions=True,
        )
        now = time.time()
        for replica, result in zip(replicas, results[: len(replicas)], strict=True):
            if isinstance(result, BaseException):
                replica.alive = False
                self.kv_index.drop(replica.name)
            else:
                replica.stats, replica.stats_at = result, now
                replica.alive = True
                self.admission.update(replica)
        for replica, events in zip(indexed, results[len(replicas) :], strict=True):
            # (removed or draining while the calls were out: its entries stay dropped)
            current = self.replicas.by_name.get(replica.name) is replica
            if current and replica.alive and not replica.draining:
                if not isinstance(events, BaseException):
                    self.kv_index.apply(replica.name, events)


def _attempt_request(request: GenerateRequest, streamed: list[int]) -> GenerateRequest:
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
