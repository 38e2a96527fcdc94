"""The cluster's Backend: dispatches requests to the prefill and decode actors over Ray.

Per request: pick a decode actor (most free KV, fewest running) and reserve KV there
(before any prefill, so prefill never produces KV that has nowhere to go); pick a prefill
actor (prefix affinity, then least queued tokens); start the prefill, which streams KV to
the reservation; stream the decode actor's tokens back. Tokens come from one long-poll loop
per decode actor that collects every request's new tokens at once, so streaming costs a
Ray call per poll, not per token. Closing a request's generator early cancels it on both
actors (their KV is freed).

In colocated mode the same loop serves ``colocated-<i>`` actors, which run both phases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray

from engine.errors import InvalidRequestError
from engine.sequence import TokenLogprobs
from engine.tokenizer import Tokenizer
from kv_transfer.errors import NoCapacityError
from router.backend import (
    Backend,
    GenerateRequest,
    NoReplica,
    Overloaded,
    RequestRejected,
    TokenDelta,
)

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 0.05
STATS_INTERVAL_S = 0.5
# A prefill replica keeps a prompt's prefix affinity unless its queue is this many tokens
# longer than the shortest one.
AFFINITY_SLACK_TOKENS = 4096


@dataclass
class Replica:
    name: str
    handle: Any
    stats: dict = field(default_factory=dict)
    alive: bool = True
    in_flight: int = 0  # requests this router sent that have not finished


def _logprobs(items: list[dict] | None) -> list[TokenLogprobs] | None:
    if items is None:
        return None
    return [TokenLogprobs(d["token_id"], d["logprob"], d.get("top") or {}) for d in items]


def _is(err: BaseException, kind: type) -> bool:
    """Ray re-raises an actor's exception as a RayTaskError that also subclasses its type."""
    return isinstance(err, kind) or isinstance(getattr(err, "cause", None), kind)


class RayBackend(Backend):
    def __init__(
        self,
        *,
        model_name: str,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int,
        block_size: int,
        decode: dict[str, Any],
        prefill: dict[str, Any] | None = None,
        colocated: bool = False,
        max_waiting: int = 1024,
        queue_timeout_s: float = 60.0,
    ) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.colocated = colocated
        self.decode = {name: Replica(name, handle) for name, handle in decode.items()}
        self.prefill = {name: Replica(name, handle) for name, handle in (prefill or {}).items()}
        self._queues: dict[str, asyncio.Queue[dict]] = {}
        self._owner: dict[str, str] = {}  # request id → decode replica
        self._tasks: list[asyncio.Task] = []
        self.transfer_bytes_total = 0
        self.transfer_seconds_total = 0.0
        # Requests wait here (bounded in number and time) while every decode replica is full.
        self.max_waiting = max_waiting
        self.queue_timeout_s = queue_timeout_s
        self.waiting = 0
        self._capacity_freed = asyncio.Event()

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        await self._refresh_stats()
        for replica in self.decode.values():
            self._tasks.append(asyncio.create_task(self._poll_loop(replica)))
        self._tasks.append(asyncio.create_task(self._stats_loop()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ---- Backend ------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        rid = request.request_id
        queue: asyncio.Queue[dict] = asyncio.Queue()
        self._queues[rid] = queue
        decode: Replica | None = None
        prefill_task: asyncio.Task | None = None
        finished = False
        try:
            decode, reservation = await self._reserve(request)
            if not self.colocated:
                prefill_task = asyncio.create_task(self._prefill(request, decode, reservation))
            first = True
            while True:
                delta = await queue.get()
                if first and request.params.logprobs is not None and prefill_task is not None:
                    # The first token was sampled on the prefill actor, which has its logprobs.
                    result = await prefill_task
                    if (
                        result is not None
                        and result.get("logprob") is not None
                        and delta["token_ids"]
                    ):
                        delta["logprobs"] = [result["logprob"], *(delta["logprobs"] or [])]
                first = False
                out = TokenDelta(
                    token_ids=delta["token_ids"],
                    logprobs=_logprobs(delta["logprobs"]),
                    finish_reason=delta["finish_reason"],
                    error=delta["error"],
                )
                if out.finish_reason is not None:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            self._owner.pop(rid, None)
            if decode is not None:
                decode.in_flight -= 1
                self._capacity_freed.set()
                if not finished:
                    decode.handle.cancel.remote(rid)
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()

    async def health(self) -> dict[str, Any]:
        decode_ready = sum(r.alive for r in self.decode.values())
        prefill_ready = sum(r.alive for r in self.prefill.values())
        ok = decode_ready > 0 and (self.colocated or prefill_ready > 0)
        return {
            "status": "ok" if ok else "degraded",
            "mode": "colocated" if self.colocated else "disaggregated",
            "prefill": prefill_ready,
            "decode": decode_ready,
        }

    def stats(self) -> dict[str, Any]:
        replicas = [*self.prefill.values(), *self.decode.values()]
        return {
            "queue_tokens": {r.name: r.stats.get("queued_tokens", 0) for r in replicas},
            "running": {r.name: r.stats.get("running", 0) for r in replicas},
            "kv_usage": {r.name: r.stats.get("kv_usage", 0.0) for r in replicas},
            "transfer_bytes_total": self.transfer_bytes_total,
            "transfer_seconds_total": self.transfer_seconds_total,
            "router_waiting": self.waiting,
        }

    def replica_stats(self) -> dict[str, dict]:
        return {
            r.name: {**r.stats, "alive": r.alive}
            for r in [*self.prefill.values(), *self.decode.values()]
        }

    # ---- routing --------------------------------------------------------------------------
    def _decode_candidates(self) -> list[Replica]:
        alive = [r for r in self.decode.values() if r.alive]

        def load(r: Replica) -> tuple:
            free = r.stats.get("free_blocks", 0) - r.in_flight  # in-flight ones will take blocks
            return (-free, r.stats.get("running", 0) + r.in_flight)

        return sorted(alive, key=load)

    def _prefill_choice(self, prompt: list[int]) -> Replica:
        alive = sorted((r for r in self.prefill.values() if r.alive), key=lambda r: r.name)
        if not alive:
            raise NoReplica("no prefill replica is ready")
        queued = {
            r.name: r.stats.get("queued_tokens", 0) + r.in_flight * len(prompt) for r in alive
        }
        # Prefix affinity: the same first block goes to the same replica, where it is cached.
        preferred = alive[hash(tuple(prompt[: self.block_size])) % len(alive)]
        least = min(alive, key=lambda r: queued[r.name])
        if queued[preferred.name] - queued[least.name] <= AFFINITY_SLACK_TOKENS:
            return preferred
        return least

    async def _reserve(self, request: GenerateRequest) -> tuple[Replica, dict]:
        candidates = self._decode_candidates()
        if not candidates:
            raise NoReplica("no decode replica is ready")
        if not self.colocated and not any(r.alive for r in self.prefill.values()):
            raise NoReplica("no prefill replica is ready")
        deadline = time.monotonic() + self.queue_timeout_s
        if self.waiting >= self.max_waiting:
            raise Overloaded(
                f"{self.waiting} requests are already waiting for KV capacity", retry_after_s=1.0
            )
        self.waiting += 1
        try:
            while True:
                reserved = await self._try_reserve(request, candidates)
                if reserved is not None:
                    return reserved
                if time.monotonic() > deadline:
                    raise Overloaded(
                        f"no decode replica had KV capacity within {self.queue_timeout_s:.0f}s",
                        retry_after_s=1.0,
                    )
                # Wait for a request to finish somewhere (or re-check shortly).
                self._capacity_freed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._capacity_freed.wait(), timeout=0.05)
                candidates = self._decode_candidates() or candidates
        finally:
            self.waiting -= 1

    async def _try_reserve(
        self, request: GenerateRequest, candidates: list[Replica]
    ) -> tuple[Replica, dict] | None:
        """Reserve on the first replica with capacity; None if all are full right now."""
        rid = request.request_id
        for replica in candidates:
            try:
                if self.colocated:
                    await replica.handle.submit.remote(
                        rid, request.prompt_token_ids, request.params
                    )
                    reservation: dict = {}
                else:
                    reservation = await replica.handle.reserve.remote(
                        rid, request.prompt_token_ids, request.params
                    )
            except Exception as err:  # noqa: BLE001 - sorted by kind below
                if _is(err, NoCapacityError):
                    continue
                if _is(err, InvalidRequestError):
                    raise RequestRejected(str(getattr(err, "cause", err))) from None
                if isinstance(err, ray.exceptions.RayActorError):
                    replica.alive = False
                    continue
                raise
            replica.in_flight += 1
            self._owner[rid] = replica.name
            return replica, reservation
        return None

    async def _prefill(
        self, request: GenerateRequest, decode: Replica, reservation: dict
    ) -> dict | None:
        """Run the prefill; on failure end the request with an error (and free its lease)."""
        rid = request.request_id
        replica = self._prefill_choice(request.prompt_token_ids)
        replica.in_flight += 1
        try:
            result = await replica.handle.prefill.remote(
                rid,
                request.prompt_token_ids,
                request.params,
                reservation["kv_address"],
                reservation["lease_id"],
            )
        except asyncio.CancelledError:
            replica.handle.cancel.remote(rid)
            raise
        except Exception as err:  # noqa: BLE001 - any failure ends this request cleanly
            if isinstance(err, ray.exceptions.RayActorError):
                replica.alive = False
            decode.handle.cancel.remote(rid)
            queue = self._queues.get(rid)
            if queue is not None:
                message = str(getattr(err, "cause", None) or err).splitlines()[-1]
                queue.put_nowait(
                    {
                        "token_ids": [],
                        "logprobs": None,
                        "finish_reason": "error",
                        "error": f"prefill failed: {message}",
                    }
                )
            return None
        finally:
            replica.in_flight -= 1
        transfer = result.get("transfer") or {}
        self.transfer_bytes_total += int(transfer.get("bytes_sent", 0) or 0)
        self.transfer_seconds_total += float(transfer.get("seconds", 0.0) or 0.0)
        return result

    # ---- background loops -------------------------------------------------------------------
    async def _poll_loop(self, replica: Replica) -> None:
        while True:
            try:
                batches = await replica.handle.poll.remote(POLL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - the actor died or is unreachable
                logger.warning("polling %s failed: %s", replica.name, err)
                replica.alive = False
                self._fail_requests_of(
                    replica, f"{replica.name} is unavailable: {type(err).__name__}"
                )
                await asyncio.sleep(1.0)
                continue
            replica.alive = True
            for rid, delta in batches.items():
                queue = self._queues.get(rid)
                if queue is not None:
                    queue.put_nowait(delta)

    def _fail_requests_of(self, replica: Replica, message: str) -> None:
        for rid, owner in list(self._owner.items()):
            if owner == replica.name and rid in self._queues:
                self._queues[rid].put_nowait(
                    {"token_ids": [], "logprobs": None, "finish_reason": "error", "error": message}
                )

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            await self._refresh_stats()

    async def _refresh_stats(self) -> None:
        replicas = [*self.prefill.values(), *self.decode.values()]
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
