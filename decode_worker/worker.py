"""The decode worker (Ray actor ``decode-<i>``): receives prefilled KV into blocks it reserved,
then decodes with continuous batching and hands tokens to the router in per-step batches.

Request life on this worker:
1. ``reserve`` (router, before prefill starts): validate, lease blocks for the prompt's KV.
   The leading blocks its own prefix cache holds go into the lease as they are, and the
   prefill sends only the rest. Where what is left is short enough that computing it here
   costs less than a remote prefill's round trip (measured: ``local_prefill_limit``), the
   request is prefilled here instead, like a colocated worker's, and never leaves.
   No capacity → ``NoCapacityError`` (the router tries another replica or answers 429).
2. The KV receive side (its own threads) writes the prefill worker's blocks into the lease; its
   final frame carries the first token and hands the request over (``_arrive``); the
   engine loop admits it before its next step, so the transfer's acknowledgement never
   waits for a decode step.
3. The engine loop decodes; each step's tokens go to the outbox; the router ``poll``s.
4. Finish, ``cancel`` (client gone) or a released lease (prefill died, transfer stalled past
   its deadline or refused: ``_released``) frees every block and ends the stream with a
   reason.

Tensor parallel (tp t): every rank receives its own KV heads into its own cache; this worker,
rank 0, owns the blocks, and mirrors each lease on the other ranks (kv_transfer.lease_mirror).
A request is admitted once every rank has its heads.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from decode_worker.outbox import TokenOutbox
from engine.errors import InvalidRequestError
from engine.llm_engine import StepResult
from engine.sampling_params import SamplingParams
from engine.sequence import Fork
from engine.tp_worker import FromRank, RankServiceFactory
from kv_transfer.connector import transport
from kv_transfer.errors import NoCapacityError
from kv_transfer.grpc_transport import GrpcRecvSide
from kv_transfer.lease import Lease, LeaseTable
from kv_transfer.lease_mirror import RankLeases
from kv_transfer.rank_services import DecodeRanks
from workers.base import WorkerBase
from workers.messages import DecodeCounters, Reservation, TokenBatch, WorkerStats

logger = logging.getLogger(__name__)


@dataclass
class PendingRequest:
    """Reserved and waiting for its KV: the prompt's sequences, the request then its forks
    (OpenAI's ``n``), which decode from the one transfer."""

    prompt_token_ids: list[int]
    members: list[Fork]  # not cancelled, in reservation order
    lease_id: str
    reserved_at: float = field(default_factory=time.monotonic)
    slots: dict[str, int] = field(init=False)  # member → its first token's index

    def __post_init__(self) -> None:
        self.slots = {m.request_id: i for i, m in enumerate(self.members)}


class EngineWorker(WorkerBase):
    """What decode and colocated workers share: a worker whose tokens go to an outbox that
    the router polls."""

    computes_prompts = False  # a decode worker's prompts arrive as KV: nothing to report

    def __init__(self, options: dict, name: str, intake=None) -> None:
        self.outbox = TokenOutbox()
        super().__init__(
            options, name, on_result=self._publish, on_error=self._fail_all, intake=intake
        )

    def _publish(self, result: StepResult) -> None:
        for request_id, entries in result.prompt_logprobs.items():
            self.outbox.prompt_logprobs(request_id, entries)
        for request_id, token, lp in result.new_tokens:
            self.outbox.add(request_id, token, lp)
        for output in result.finished:
            computed = self._computed_prompt(output.request_id)
            self.outbox.finish(
                output.request_id,
                output.finish_reason,
                num_cached_tokens=output.num_cached_tokens if computed else None,
            )

    def _computed_prompt(self, request_id: str) -> bool:
        """Whether this worker computed the finished ``request_id``'s prompt (its prefix
        cache's account of it is the one to report); asked once per finished request."""
        return self.computes_prompts

    def _fail_all(self, err: Exception) -> None:
        """A step crashed: end every request with an error (and free its blocks) rather than
        leave streams hanging."""
        for request_id in self.engine.request_ids():
            self.engine.abort(request_id)
            self.outbox.finish(request_id, "error", f"{self.name}: engine step failed: {err}")

    def poll(self, timeout_s: float = 0.05) -> dict[str, TokenBatch]:
        """New tokens of every request since the last poll (waits up to ``timeout_s``)."""
        return self.outbox.collect(timeout_s)

    def cancel(self, request_id: str) -> bool:
        with self.loop.lock:
            found = self.engine.abort(request_id) is not None
        if found:
            self.outbox.finish(request_id, "abort")
        return found


# Recent remote prefills' round trips (reserve → KV arrived) kept for the local-prefill
# limit; it takes their lower quartile, the round trip a short or cached prompt costs.
REMOTE_ROUND_TRIPS = 64


class DecodeWorker(EngineWorker):
    def __init__(self, options: dict, name: str = "decode-0") -> None:
        self._arrived: collections.deque[Lease] = collections.deque()  # transfers done
        self._local: set[str] = set()  # requests (and forks) prefilled here, unfinished
        self._round_trips: collections.deque[float] = collections.deque(maxlen=REMOTE_ROUND_TRIPS)
        self.remote_prefills = self.reused_blocks = 0
        self.local_prefills = self.local_prefill_tokens = 0
        super().__init__(options, name, intake=self._admit_arrived)
        kv = self.options.kv
        self.pending: dict[str, PendingRequest] = {}  # by its request id (its lease's)
        self._member_of: dict[str, str] = {}  # a pending fork → its request id
        engine, tp = self.engine, self.tensor_parallel_size
        peers = RankLeases(tuple(range(1, tp)), engine.send_to_ranks) if tp > 1 else None
        self.leases = LeaseTable(
            engine.block_manager,
            self.loop.lock,
            kv.lease_timeout_s,
            on_complete=self._arrive,
            on_release=self._released,
            peers=peers,
        )
        fingerprint = engine.model_config.fingerprint()
        if tp > 1:  # each rank receives its own heads, over gRPC
            heads = engine.layout.kv_heads_by_rank()[0]
            self.kv = GrpcRecvSide(fingerprint, kv, heads, tuple(engine.rank_infos))
        else:
            self.kv = transport(kv.transport).recv_side(fingerprint, kv)
        self.kv.start(engine.cache, self.leases)
        self.loop.start()

    def rank_service(self) -> RankServiceFactory | None:
        return DecodeRanks(self.options.kv) if self.tensor_parallel_size > 1 else None

    def _from_rank(self, message: FromRank) -> None:
        """A rank's word on a lease (on the engine's listener thread)."""
        RankLeases.deliver(self.leases, message.rank, message.payload)

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        forks: tuple[Fork, ...] = (),
        local_prefill_limit: int | None = 0,
    ) -> Reservation:
        """Lease blocks for the prompt's KV before its prefill starts; ``forks`` will decode
        from the same blocks. The reservation is what the prefill streams into: the blocks
        this worker's prefix cache holds are leased as they are and not sent. Where at most
        ``local_prefill_limit`` prompt tokens are left to compute (None: this worker's
        measured limit; 0: never), it prefills them itself and the reservation says
        ``local``: no prefill replica is asked.

        Raises InvalidRequestError for a request this worker can never serve and
        NoCapacityError when it cannot take it now."""
        engine = self.engine
        members = [Fork(request_id, params), *forks]
        with self.loop.lock:
            engine.validate_request(prompt_token_ids, params, forks)
            for member in members:
                if self._is_pending(member.request_id) or engine.has_request(member.request_id):
                    raise InvalidRequestError(f"request id {member.request_id!r} is already in use")
            scheduler = engine.scheduler
            busy = len(scheduler.running) + len(scheduler.waiting) + self._num_pending()
            if busy + len(members) > engine.config.max_num_seqs:
                raise NoCapacityError(
                    f"{self.name} is at its limit of {engine.config.max_num_seqs} sequences"
                )
            bm = engine.block_manager
            cached = bm.cached_prefix_tokens(prompt_token_ids)
            # Keep a block of headroom per running sequence (and fork) so admissions do not
            # force immediate preemptions.
            needed = bm.blocks_needed(len(prompt_token_ids) + 1) - cached // bm.block_size
            if needed + len(forks) + len(scheduler.running) > bm.num_free_blocks:
                raise NoCapacityError(f"{self.name} has {bm.num_free_blocks} free KV blocks")
            limit = (
                self.local_prefill_limit() if local_prefill_limit is None else local_prefill_limit
            )
            if len(prompt_token_ids) - cached <= limit:
                engine.add_request(list(prompt_token_ids), params, request_id, forks)
                self._local.update(m.request_id for m in members)
                self.local_prefills += 1
                self.local_prefill_tokens += len(prompt_token_ids) - cached
                self.loop.wake()
                return Reservation(local=True, cached_tokens=cached)
            lease = self.leases.reserve(
                request_id, len(prompt_token_ids), token_ids=prompt_token_ids
            )
            self.pending[request_id] = PendingRequest(
                list(prompt_token_ids), members, lease.lease_id
            )
            for fork in forks:
                self._member_of[fork.request_id] = request_id
        handle = self.kv.handle_for(lease)
        if lease.first_block:
            handle = dataclasses.replace(handle, first_block=lease.first_block)
        return Reservation(handle, cached_tokens=lease.first_block * bm.block_size)

    def local_prefill_limit(self) -> int:
        """The most prompt tokens this worker prefills itself rather than have a prefill
        replica send them: as many as its own measured prefill rate computes within the
        round trip a remote prefill costs here (reserve → KV arrived, their lower quartile:
        what a short or cached prompt pays for dispatch, handshake and transfer), at most a
        step's token budget. With no round trip measured yet, none; with no prefill of its
        own measured yet, one block (the first such prefill measures the rate). Engine lock
        held."""
        if not self._round_trips:
            return 0
        engine = self.engine
        cost = engine.step_cost.estimate()
        if cost is None or not cost.prompt_tokens or cost.per_token_s <= 0:
            return engine.block_manager.block_size
        round_trip = sorted(self._round_trips)[len(self._round_trips) // 4]
        return min(engine.config.max_num_batched_tokens, int(round_trip / cost.per_token_s))

    def _fail_all(self, err: Exception) -> None:
        super()._fail_all(err)
        self._local.clear()  # every request of the engine ended

    def _computed_prompt(self, request_id: str) -> bool:
        if request_id in self._local:
            self._local.discard(request_id)
            return True
        return False

    def _is_pending(self, request_id: str) -> bool:
        return request_id in self.pending or request_id in self._member_of

    def _num_pending(self) -> int:
        return sum(len(p.members) for p in self.pending.values())

    def _pop_pending(self, request_id: str) -> PendingRequest | None:
        """Take a pending request (by its lease's request id) off the books, forks and all."""
        pending = self.pending.pop(request_id, None)
        for member in pending.members if pending is not None else ():
            self._member_of.pop(member.request_id, None)  # (cancelled ones left it already)
        return pending

    def _arrive(self, lease: Lease) -> None:
        """The KV receiver finished a transfer (on its thread): the blocks are now ours. They
        are admitted by the engine loop before its next step; the receiver does not wait."""
        self._arrived.append(lease)
        self.loop.wake()

    def _admit_arrived(self) -> None:
        """On the engine loop, its lock held: start decoding every request whose KV arrived."""
        while self._arrived:
            self._admit(self._arrived.popleft())

    def _admit(self, lease: Lease) -> None:
        if lease.ready_event is not None:  # CUDA: the engine's stream waits for the copies
            torch.cuda.current_stream(self.engine.device).wait_event(lease.ready_event)
        pending = self._pop_pending(lease.request_id)
        if pending is None or not pending.members:  # cancelled meanwhile: free the blocks
            self.engine.block_manager.free(list(lease.block_ids))
            return
        self._round_trips.append(time.monotonic() - pending.reserved_at)
        self.remote_prefills += 1
        self.reused_blocks += lease.first_block
        head, *forks = pending.members
        try:
            tokens = [lease.first_token, *lease.fork_tokens]
            if len(tokens) != len(pending.slots):
                raise InvalidRequestError(
                    f"the transfer brought {len(tokens)} first tokens for {len(pending.slots)} "
                    "sequences"
                )
            _, result = self.engine.admit_prefilled(
                pending.prompt_token_ids,
                head.params,
                head.request_id,
                list(lease.block_ids),
                tokens[pending.slots[head.request_id]],
                [(f, tokens[pending.slots[f.request_id]]) for f in forks],
            )
        except Exception as err:  # noqa: BLE001 - never strand the blocks or the stream
            if self.engine.has_request(head.request_id):
                for member in pending.members:
                    self.engine.abort(member.request_id)  # frees the blocks
            else:
                self.engine.block_manager.free(list(lease.block_ids))
            for member in pending.members:
                self.outbox.finish(
                    member.request_id, "error", f"{self.name}: admission failed: {err}"
                )
            return
        self._publish(result)

    def _released(self, lease: Lease) -> None:
        """A lease went without its KV (the transfer failed, stalled past its deadline, or
        was refused): its requests end with the reason, retryable (nothing decoded here yet:
        another attempt, with another transfer, can serve them). On the releasing thread."""
        with self.loop.lock:
            pending = self.pending.get(lease.request_id)
            if pending is None or pending.lease_id != lease.lease_id:
                return  # cancelled by the router (already off the books)
            self._pop_pending(lease.request_id)
        for member in pending.members:
            self.outbox.finish(
                member.request_id,
                "error",
                f"{self.name}: KV transfer for {lease.request_id} failed ({lease.release_reason})",
                retryable=True,
            )

    def cancel(self, request_id: str) -> bool:
        with self.loop.lock:
            self._local.discard(request_id)
            owner = self._member_of.get(request_id, request_id)
            pending = self.pending.get(owner)
            if pending is not None and any(m.request_id == request_id for m in pending.members):
                pending.members = [m for m in pending.members if m.request_id != request_id]
                self._member_of.pop(request_id, None)
                if not pending.members:  # nobody left to decode the transfer
                    self._pop_pending(owner)
                    self.leases.release(pending.lease_id, "cancelled")
                self.outbox.finish(request_id, "abort")
                return True
        return super().cancel(request_id)

    def stats(self) -> WorkerStats:
        with self.loop.lock:
            counters = DecodeCounters(
                pending_transfers=len(self.pending),
                pending_sequences=self._num_pending(),
                leases=self.leases.active(),
                kv=self.kv.stats(),
                remote_prefills=self.remote_prefills,
                reused_blocks=self.reused_blocks,
                local_prefills=self.local_prefills,
                local_prefill_tokens=self.local_prefill_tokens,
                local_prefill_limit=self.local_prefill_limit(),
            )
        return self.worker_stats(decode=counters)

    def shutdown(self) -> None:
        self.kv.stop()
        super().shutdown()
