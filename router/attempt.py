"""One attempt at a request: reserve decode capacity → prefill → stream its tokens.

An :class:`AttemptStart` is where an attempt's sequences begin: one reservation and one
prefill, shared by the n sequences of one prompt (OpenAI's ``n``) on their first attempt, of
one sequence otherwise. :meth:`Attempts.run` streams one sequence of a start; a failure it
cannot get past raises :class:`AttemptFailed` for the caller to retry or migrate.

Used from the router's event loop only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import ray

from engine.block_manager import kv_cache_misfit
from engine.errors import InvalidRequestError
from engine.prefix_hash import block_hashes
from engine.sequence import Fork
from kv_transfer.errors import NoCapacityError
from router.backend import GenerateRequest, NoReplica, Overloaded, RequestRejected, TokenDelta
from router.config import RouterLimits
from router.decode_line import DecodeLine, LineTimeout
from router.dispatch import Colocated, Disaggregated
from router.kv_index import KVIndex
from router.prefill_routing import PrefillPolicy, choose_prefill
from router.replicas import Replica, ReplicaSet
from router.slo_admission import SLOAdmission
from router.timeline import RequestTimeline
from router.token_streams import PrefillToken, Retry, TokenStreams, error_message
from workers.messages import PrefillResult, Reservation, TokenBatch
from workers.pool import Pool


class AttemptFailed(Exception):
    """This attempt failed in a way another attempt can fix; the message says why."""


class AttemptStart:
    """The reservation and prefill that ``requests`` (sequences of one prompt) share.
    ``task`` (reserve, then start the prefill) runs once, for whichever sequence asks first;
    the last sequence to leave cancels what is still running."""

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

    @property
    def forks(self) -> tuple[Fork, ...]:
        """The sequences after the first, as the workers take them."""
        pairs = zip(self.worker_rids[1:], self.requests[1:], strict=True)
        return tuple(Fork(rid, request.params) for rid, request in pairs)


@dataclass
class TransportCounters:
    """The KV transfers one transport (kv.transport) carried."""

    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class PrefillCounters:
    prefills: int = 0  # prefill calls that succeeded
    transfers: int = 0  # and the KV transfers they made
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    by_transport: dict[str, TransportCounters] = field(default_factory=dict)

    def count(self, result: PrefillResult) -> None:
        self.prefills += 1
        if not result.transferred:
            return
        self.transfers += 1
        self.transfer_bytes += result.transfer_bytes
        self.transfer_seconds += result.transfer_seconds
        mine = self.by_transport.setdefault(result.transport, TransportCounters())
        mine.transfers += 1
        mine.bytes += result.transfer_bytes
        mine.seconds += result.transfer_seconds


class Attempts:
    def __init__(
        self,
        *,
        replicas: ReplicaSet,
        streams: TokenStreams,
        admission: SLOAdmission,
        line: DecodeLine,
        dispatch: Disaggregated | Colocated,
        limits: RouterLimits,
        block_size: int,
        max_model_len: int,
        kv_cache_tokens: int | None,
        on_forecast_error: Callable[[float], None],
        kv_index: KVIndex,
        prefill_policy: PrefillPolicy = PrefillPolicy.KV_AWARE,
    ) -> None:
        """``kv_cache_tokens``: a decode replica's KV cache size (a request that can never
        fit it is refused with 400 before admission); ``on_forecast_error``: each TTFT
        forecast's error, in seconds, as first tokens arrive; ``kv_index``: what each
        replica's prefix cache holds, which ``prefill_policy`` may route by."""
        self.replicas = replicas
        self.streams = streams
        self.admission = admission
        self.line = line
        self.dispatch = dispatch
        self.limits = limits
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_cache_tokens = kv_cache_tokens
        self.on_forecast_error = on_forecast_error
        self.kv_index = kv_index
        self.prefill_policy = prefill_policy
        self.counters = PrefillCounters()
        self.routing_decisions: dict[str, int] = {}  # prefill choices by reason
        # Where prompts were prefilled (a prefill replica, or the decode replica itself:
        # "remote", "local"), and the prompt tokens decode replicas' own caches held.
        self.prefill_paths: dict[str, int] = {}
        self.decode_reused_tokens = 0

    async def run(
        self, start: AttemptStart, index: int, served_by: set[str]
    ) -> AsyncIterator[TokenDelta]:
        """The ``index``-th sequence of ``start``: once the start has its reservation (and
        its prefill is under way), the sequence's tokens as they arrive."""
        request, worker_rid = start.requests[index], start.worker_rids[index]
        queue = self.streams.open(worker_rid)
        decode: Replica | None = None
        finished = False
        last_delivery: float | None = None
        timeline = start.timeline
        # The first token reaches the router twice in disaggregated mode: with the prefill
        # call's result (sent on at once) and at the head of the decode replica's stream.
        first_sent = False
        skip_decode_first = False
        first_delta = True
        wants_prefill_result = (
            request.params.logprobs is not None or request.params.prompt_logprobs is not None
        )
        try:
            if start.task is None:
                start.task = asyncio.create_task(self._begin(start))
            decode = await asyncio.shield(start.task)
            served_by.add(decode.name)
            self.admission.slot_taken(worker_rid, decode.name, request.params.max_tokens)
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=self.limits.idle_timeout_s)
                except asyncio.TimeoutError:
                    raise AttemptFailed(
                        f"no token from {decode.name} for {self.limits.idle_timeout_s:.0f}s"
                    ) from None
                if isinstance(event, Retry):
                    raise AttemptFailed(event.reason)
                if isinstance(event, TokenBatch) and event.retryable:  # its KV never arrived
                    raise AttemptFailed(event.error or "the decode replica gave the request up")
                if isinstance(event, PrefillToken):
                    if first_sent:
                        continue  # the decode replica's stream was quicker
                    first_sent = skip_decode_first = True
                    batch = TokenBatch(
                        token_ids=(event.token_id,),
                        logprobs=None if event.logprob is None else (event.logprob,),
                        prompt_logprobs=event.prompt_logprobs,
                    )
                    first_delta = False
                else:
                    batch = event
                    if skip_decode_first and batch.token_ids:
                        # Already sent; the decode stream has no logprob for it (it was
                        # sampled on the prefill replica), so only the token goes.
                        skip_decode_first = False
                        batch = dataclasses.replace(batch, token_ids=batch.token_ids[1:])
                        if not batch.token_ids and batch.finish_reason is None:
                            continue
                if first_delta and wants_prefill_result and start.prefill_task is not None:
                    # Sampled on the prefill actor, which has the first token's logprobs
                    # (and the prompt's).
                    result = await asyncio.shield(start.prefill_task)
                    if result is not None and batch.token_ids:
                        first = result.first_tokens[index]
                        logprobs = batch.logprobs
                        if first.logprob is not None:
                            logprobs = (first.logprob, *(batch.logprobs or ()))
                        batch = dataclasses.replace(
                            batch, logprobs=logprobs, prompt_logprobs=result.prompt_logprobs
                        )
                first_delta = False
                first_sent = first_sent or bool(batch.token_ids)
                now = time.monotonic()
                if batch.token_ids:
                    self._first_token(start, now)
                gap_s = None if last_delivery is None else now - last_delivery
                self.admission.delivered(worker_rid, decode.name, now, len(batch.token_ids), gap_s)
                last_delivery = now
                finishing = batch.finish_reason is not None
                finished = finishing
                yield TokenDelta(
                    token_ids=list(batch.token_ids),
                    logprobs=None if batch.logprobs is None else list(batch.logprobs),
                    finish_reason=batch.finish_reason,
                    error=batch.error,
                    # by the end the prefill's own account is in, whichever path came first
                    timings=timeline.stages() if finishing and timeline.first_token else None,
                    prompt_logprobs=None
                    if batch.prompt_logprobs is None
                    else list(batch.prompt_logprobs),
                    cached_tokens=self._cached_tokens(start, batch) if finishing else None,
                )
                if finishing:
                    return
        finally:
            self._leave(start, index, decode, finished, served_by)

    @staticmethod
    def _cached_tokens(start: AttemptStart, last: TokenBatch) -> int | None:
        """The prompt tokens a prefix cache served: the prefill replica's (disaggregated),
        or the worker's that computed the prompt itself (colocated)."""
        task = start.prefill_task
        if task is not None and task.done() and not task.cancelled() and task.exception() is None:
            result = task.result()
            if result is not None:
                return result.num_cached_tokens
        return last.num_cached_tokens

    def _first_token(self, start: AttemptStart, now: float) -> None:
        """A token of ``start`` reached the router: the first ends its prompt's backlog."""
        if start.backlog:
            self.admission.prefill_backlog_tokens -= start.backlog
            start.backlog = 0
        if start.timeline.first_token is None:
            error_s = self.admission.first_token(start.worker_rids[0], now)
            if error_s is not None:
                self.on_forecast_error(error_s)
            start.timeline.first_token = now

    def _leave(
        self,
        start: AttemptStart,
        index: int,
        decode: Replica | None,
        finished: bool,
        served_by: set[str],
    ) -> None:
        """Sequence ``index`` is done with this attempt (finished, failed or closed)."""
        worker_rid = start.worker_rids[index]
        self.streams.close(worker_rid)
        self.admission.sequence_ended(worker_rid)
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
            self.admission.prefill_backlog_tokens -= start.backlog
            start.backlog = 0
            for running in (start.task, start.prefill_task):
                if running is not None and not running.done():
                    running.cancel()

    async def _begin(self, start: AttemptStart) -> Replica:
        """Reserve decode capacity for every sequence of ``start`` and start its prefill."""
        head = start.requests[0]
        decode, reservation = await self.reserve(
            head, start.worker_rids[0], start.admitted, start.timeline, start.forks
        )
        for index in start.gone:  # left while it reserved
            self._release_slot(decode, start.worker_rids[index], cancel=True)
        start.backlog = len(head.prompt_token_ids)
        self.admission.prefill_backlog_tokens += start.backlog
        if self.dispatch.has_prefill_pool:
            path = "local" if reservation.local else "remote"
            self.prefill_paths[path] = self.prefill_paths.get(path, 0) + 1
            self.decode_reused_tokens += reservation.cached_tokens
            if not reservation.local:  # else the decode replica computes the prompt itself
                start.prefill_task = asyncio.create_task(self._prefill(start, reservation))
        return decode

    def _release_slot(self, decode: Replica, worker_rid: str, cancel: bool) -> None:
        """A sequence is done with its slot on ``decode`` (cancelled there if unfinished)."""
        decode.in_flight -= 1
        self.streams.disown(worker_rid)
        self.admission.slot_freed()
        self.line.wake_front()
        if cancel and decode.alive:
            decode.handle.cancel.remote(worker_rid)

    # ---- reserve ------------------------------------------------------------------------
    async def reserve(
        self,
        request: GenerateRequest,
        worker_rid: str,
        admitted: bool,
        timeline: RequestTimeline,
        forks: tuple[Fork, ...] = (),
    ) -> tuple[Replica, Reservation]:
        """The static limits, SLO admission (not for an ``admitted`` request's retry), then a
        place in the line until a decode replica reserves KV for the request (and slots for
        its ``forks``)."""
        limits, pool = self.limits, self.dispatch.decode_pool
        self._check_fits_kv_cache(request)
        if not self.replicas.decode_candidates(pool, set()):
            raise NoReplica(f"no {pool} replica is ready")
        if self.dispatch.has_prefill_pool:
            if not self.replicas.prefill_candidates():
                raise NoReplica("no prefill replica is ready")
            queued = sum(r.stats.load.queued_tokens for r in self.replicas.pool(Pool.PREFILL))
            if queued + len(request.prompt_token_ids) > limits.max_prefill_queue_tokens:
                raise Overloaded(
                    f"{queued} prompt tokens are already queued for prefill", retry_after_s=1.0
                )
        if self.line.waiting >= limits.max_waiting:
            raise Overloaded(
                f"{self.line.waiting} requests are already waiting for KV capacity",
                retry_after_s=1.0,
            )
        slo = not admitted and self.admission.slo is not None
        if slo:
            self.admission.check(
                request,
                worker_rid,
                1 + len(forks),
                self.replicas.decode_candidates(pool, set()),
                [r.name for r in self.replicas.pool(self.dispatch.prefill_pool)],
                pool,
            )
        try:
            return await self.line.reserve(
                worker_rid,
                lambda: self._try_reserve(request, worker_rid, slo, forks),
                limits.queue_timeout_s,
                timeline,
                front=admitted,
            )
        except LineTimeout:
            raise Overloaded(
                f"no {pool} replica had capacity within {limits.queue_timeout_s:.0f}s",
                retry_after_s=1.0,
            ) from None

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

    async def _try_reserve(
        self,
        request: GenerateRequest,
        worker_rid: str,
        within_slots: bool,
        forks: tuple[Fork, ...],
    ) -> tuple[Replica, Reservation] | None:
        """Reserve on the first replica with capacity (and, ``within_slots``, under its
        SLO slot limit); None if all are full right now. The request and its forks count a
        slot each."""
        pool = self.dispatch.decode_pool
        prompt, now = request.prompt_token_ids, time.monotonic()
        hashes = block_hashes(prompt, self.block_size, len(prompt) - 1)
        candidates = self.replicas.decode_candidates(
            pool, set(), lambda r: self.kv_index.overlap(r.name, hashes, now)
        )
        if not candidates:
            raise NoReplica(f"no {pool} replica is ready")
        width = 1 + len(forks)
        if within_slots:
            candidates = [r for r in candidates if self.admission.has_slots(r, width)]
        for replica in candidates:
            # Counted from now, so that reservations made side by side respect the limit.
            replica.in_flight += width
            try:
                reservation = await self.dispatch.reserve(
                    replica.handle, worker_rid, request, forks
                )
            except BaseException as err:  # noqa: BLE001 - sorted by kind below
                replica.in_flight -= width
                if not isinstance(err, Exception):
                    raise  # cancelled: the client went away
                if _is(err, NoCapacityError):
                    limit = self.admission.slot_limits.get(replica.name)
                    if limit is not None:
                        limit.full_at(replica.in_flight)
                    continue
                if _is(err, InvalidRequestError):
                    raise RequestRejected(error_message(err)) from None
                if isinstance(err, ray.exceptions.RayActorError):
                    replica.alive = False
                    continue
                raise
            for rid in (worker_rid, *(f.request_id for f in forks)):
                self.streams.owned_by(rid, replica.name)
            return replica, reservation
        return None

    # ---- prefill ------------------------------------------------------------------------
    async def _prefill(self, start: AttemptStart, reservation: Reservation) -> PrefillResult | None:
        """Run the prefill (one for all of ``start``'s sequences). On failure, each of them
        is retried (a fresh reservation, another prefill replica if this one died)."""
        request, rids, timeline = start.requests[0], start.worker_rids, start.timeline
        prompt = request.prompt_token_ids
        # The blocks the engine's prefix cache could serve: never the one with the last token
        hashes = block_hashes(prompt, self.block_size, len(prompt) - 1)
        now = time.monotonic()
        choice = choose_prefill(
            self.prefill_policy,
            self.replicas.prefill_candidates(),
            prompt,
            hashes,
            self.kv_index,
            self.block_size,
            now,
        )
        if choice is None:
            self._signal_all(rids, Retry("no prefill replica is ready"))
            return None
        replica = choice.replica
        self.routing_decisions[choice.reason] = self.routing_decisions.get(choice.reason, 0) + 1
        if request.params.prompt_logprobs is None:  # (such a prompt skips the cache)
            self.kv_index.predict(replica.name, hashes, now)
        computing = choice.computed_tokens
        start.prefill_name = replica.name
        replica.in_flight += 1
        replica.prefill_tokens += computing
        timeline.prefill_sent = now
        try:
            result = await replica.handle.prefill.remote(
                rids[0],
                request.prompt_token_ids,
                request.params,
                reservation,
                forks=start.forks,
            )
        except asyncio.CancelledError:
            replica.handle.cancel.remote(rids[0])
            raise
        except Exception as err:  # noqa: BLE001 - any failure ends this attempt cleanly
            if isinstance(err, ray.exceptions.RayActorError):
                replica.alive = False
            self._signal_all(rids, Retry(f"prefill on {replica.name} failed: {error_message(err)}"))
            return None
        finally:
            replica.in_flight -= 1
            replica.prefill_tokens -= computing
        timeline.prefill_returned = time.monotonic()
        timeline.worker = result.times.to_dict()
        for rid, first in zip(rids, result.first_tokens, strict=True):
            self.streams.signal(
                rid, PrefillToken(first.token_id, first.logprob, result.prompt_logprobs)
            )
        self.counters.count(result)
        return result

    def _signal_all(self, worker_rids: list[str], event: Retry) -> None:
        for rid in worker_rids:
            self.streams.signal(rid, event)


def _is(err: BaseException, kind: type) -> bool:
    """Ray re-raises an actor's exception as a RayTaskError that also subclasses its type."""
    return isinstance(err, kind) or isinstance(getattr(err, "cause", None), kind)
