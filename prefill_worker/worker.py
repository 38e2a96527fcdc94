"""The prefill worker (Ray actor ``prefill-<i>``): runs prompts and streams their KV, layer by
layer, into the blocks a decode worker reserved for them; returns the first token.

Prompts waiting here are batched up to the engine's token budget and long ones are chunked
(the engine's scheduler); prompts sharing a prefix reuse its cached blocks (prefix cache),
so a repeated system prompt is not recomputed. Each request samples exactly one token here,
and so does each of its forks (OpenAI's ``n``: one prefill, one transfer, n first tokens).
While a chunk of a prompt runs, every finished layer's newly complete blocks (the first
chunk also ships the cached prefix; the last, the partial tail block) are handed to the KV
sender, which ships them while later layers and later chunks compute: layer by layer for a
long chunk, in a few bursts for a short one (``kv.layer_burst_bytes``), as each send costs
the forward the sending threads' turn on the GIL and the cores. A stream that reads the blocks
in place (NIXL) gets them held, a reference each, until it says it is done with them.

Tensor parallel (tp t): every rank holds some of the KV heads and sends them itself, to the
decode rank(s) that hold them (kv_transfer.rank_services); this worker, rank 0, tells the
other ranks which blocks each step ships, and a prefill succeeds only once every rank's
streams were accepted.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from engine.errors import EngineError
from engine.llm_engine import LayerCallbacks, StepResult
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Fork, TokenLogprobs
from engine.tp_group import TensorParallelError
from engine.tp_worker import FromRank, RankServiceFactory
from kv_transfer.connector import KVSendStream, transport
from kv_transfer.grpc_transport import GrpcSendSide
from kv_transfer.rank_services import AbortTransfer, OpenTransfer, PrefillRanks, Shipment
from workers.base import WorkerBase
from workers.messages import (
    FirstToken,
    PrefillCounters,
    PrefillResult,
    PrefillTimes,
    Reservation,
    WorkerStats,
)

logger = logging.getLogger(__name__)


class PrefillError(Exception):
    """The prefill or its KV transfer failed; the message says which and why."""


@dataclass
class PrefillJob:
    request_id: str
    stream: KVSendStream
    members: list[str]  # the request's id, then its forks'
    done: threading.Event = field(default_factory=threading.Event)
    first_tokens: dict[str, FirstToken] = field(default_factory=dict)  # member → its first
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    unfinished: set[str] = field(init=False)  # members whose first token is still to come
    num_cached_tokens: int = 0
    blocks_sent: int = 0  # of every layer: blocks [0, blocks_sent) are on their way
    # A stream that reads in place (NIXL): the cache blocks it was given, held (a reference
    # each) until it says nothing reads them any more, and whether it has said so.
    held_blocks: list[int] = field(default_factory=list)
    sources_free: bool = False
    error: str | None = None
    started: float = field(default_factory=time.monotonic)
    scheduled: float | None = None  # its first chunk's step began
    computed: float | None = None  # its first token was sampled
    # Tensor parallel: the other ranks' TransferOutcomes, and when all of them are in.
    rank_outcomes: dict = field(default_factory=dict)
    ranks_done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.unfinished = set(self.members)


class PrefillWorker(WorkerBase):
    def __init__(self, options: dict, name: str = "prefill-0") -> None:
        self.jobs: dict[str, PrefillJob] = {}
        self.completed = 0
        self.failed = 0
        self.transfer_seconds = 0.0
        self.transfers: dict[str, PrefillJob] = {}  # tensor parallel: by request id
        super().__init__(
            options,
            name,
            on_result=self._on_result,
            on_error=self._fail_all,
            layer_hook=self._layer_hook,
        )
        kv, engine = self.options.kv, self.engine
        fingerprint = engine.model_config.fingerprint()
        if self.tensor_parallel_size > 1:  # each rank sends its own heads, over gRPC
            heads = engine.layout.kv_heads_by_rank()
            self.kv = GrpcSendSide(engine.cache, fingerprint, kv, 0, heads)
        else:
            self.kv = transport(kv.transport).send_side(engine.cache, fingerprint, kv)
        self.loop.start()

    def rank_service(self) -> RankServiceFactory | None:
        return PrefillRanks(self.options.kv) if self.tensor_parallel_size > 1 else None

    # ---- Ray-facing API ---------------------------------------------------------------
    def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        reservation: Reservation,
        timeout_s: float = 600.0,
        forks: tuple[Fork, ...] = (),
    ) -> PrefillResult:
        """Prefill one prompt, stream its KV into ``reservation`` (a decode worker's), return
        its first token and each fork's. Blocks the calling thread (the actor runs calls
        concurrently); raises PrefillError on failure (the receiver then frees the lease's
        blocks)."""
        engine = self.engine
        one_token = lambda p: dataclasses.replace(
            p, max_tokens=1, min_tokens=0, stop=(), stop_token_ids=()
        )
        first_forks = [Fork(f.request_id, one_token(f.params)) for f in forks]
        if reservation.kv is None:
            raise PrefillError(f"{self.name}: {request_id} has no KV handle to stream to")
        stream = self.kv.open(reservation.kv, request_id, len(prompt_token_ids))
        members = [request_id, *(f.request_id for f in forks)]
        # The decode replica's own prefix cache holds the blocks before first_block
        job = PrefillJob(request_id, stream, members, blocks_sent=reservation.kv.first_block)
        if stream.reads_in_place:
            stream.on_sources_free(lambda: self._free_sources(job))
        with self.loop.lock:
            try:
                seq = engine.add_request(
                    list(prompt_token_ids), one_token(params), request_id, first_forks
                )
            except EngineError as err:
                stream.abort(str(err))
                raise PrefillError(f"{self.name}: {err}") from None
            for member in members:
                self.jobs[member] = job
            if self.tensor_parallel_size > 1:
                self.transfers[request_id] = job
                engine.send_to_ranks(
                    OpenTransfer(request_id, reservation.kv, len(prompt_token_ids))
                )
        self.loop.wake()
        try:
            return self._await(job, seq, timeout_s)
        finally:
            self.transfers.pop(request_id, None)

    def _await(self, job: PrefillJob, seq, timeout_s: float) -> PrefillResult:
        """Wait for the prefill, then for its transfer (every rank's); its result."""
        request_id, members, stream = job.request_id, job.members, job.stream
        if not job.done.wait(timeout_s):
            self.cancel(request_id)
            raise PrefillError(
                f"{self.name}: prefill of {request_id} did not finish in {timeout_s:.0f}s"
            )
        if job.error is not None:
            self.failed += 1
            stream.abort(job.error)
            with self.loop.lock:
                self._abort_ranks(request_id, job.error)
            raise PrefillError(job.error)
        transfer_start = time.monotonic()
        try:
            transfer = stream.finish(
                job.first_tokens[request_id].token_id,
                [job.first_tokens[m].token_id for m in members[1:]],
            )
            rank_bytes = self._await_ranks(job)
        except Exception as err:  # the receiver's status, or a broken channel
            self.failed += 1
            raise PrefillError(f"{self.name}: KV transfer of {request_id} failed: {err}") from None
        finished = time.monotonic()
        self.transfer_seconds += finished - transfer_start
        self.completed += 1
        scheduled = job.scheduled or job.started
        computed = job.computed or transfer_start
        return PrefillResult(
            first_tokens=tuple(job.first_tokens[m] for m in members),
            prompt_logprobs=job.prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
            prefill_s=finished - job.started,
            times=PrefillTimes(  # where the worker's time went (router/timeline.py)
                wait_s=scheduled - job.started,
                compute_s=computed - scheduled,
                transfer_finish_s=finished - computed,
            ),
            transfer_bytes=transfer.payload_bytes + rank_bytes,
            transfer_seconds=transfer.seconds,
            transport=stream.transport,
        )

    def _await_ranks(self, job: PrefillJob) -> int:
        """Tensor parallel: wait until every other rank's streams were accepted; the bytes
        they sent. Raises PrefillError with the first rank's failure."""
        if self.tensor_parallel_size == 1:
            return 0
        if not job.ranks_done.wait(self.options.kv.lease_timeout_s + 5.0):
            raise PrefillError("the other tensor-parallel ranks never finished their streams")
        errors = [o.error for o in job.rank_outcomes.values() if o.error is not None]
        if errors:
            raise PrefillError(errors[0])
        return sum(o.payload_bytes for o in job.rank_outcomes.values())

    def _from_rank(self, message: FromRank) -> None:
        """A rank's TransferOutcome (on the engine's listener thread)."""
        outcome = message.payload
        job = self.transfers.get(outcome.request_id)
        if job is None:
            return  # over already (failed, cancelled)
        job.rank_outcomes.setdefault(message.rank, outcome)
        if outcome.error is not None:  # fail it now: the other ranks' streams stop
            failure = f"{self.name}: KV transfer of {job.request_id} failed: {outcome.error}"
            job.error = job.error or failure
        if len(job.rank_outcomes) == self.tensor_parallel_size - 1:
            job.ranks_done.set()

    def _abort_ranks(self, request_id: str, reason: str) -> None:
        """Tensor parallel: end the request's streams on every other rank (lock held)."""
        if self.tensor_parallel_size == 1:
            return
        try:
            self.engine.send_to_ranks(AbortTransfer(request_id, reason))
        except TensorParallelError:
            pass  # a rank is gone: the replica ends anyway

    def cancel(self, request_id: str) -> bool:
        """Cancel a prefill (the whole of it: the request and its forks)."""
        with self.loop.lock:
            job = self.jobs.get(request_id)
            if job is None:
                return False
            for member in reversed(job.members):  # forks first: nothing is handed on
                self.jobs.pop(member, None)
                self.engine.abort(member)
            self._abort_ranks(request_id, "cancelled")
        job.stream.abort("cancelled")
        job.error = f"{self.name}: {request_id} was cancelled"
        job.done.set()
        return True

    def stats(self) -> WorkerStats:
        counters = PrefillCounters(self.completed, self.failed, self.transfer_seconds)
        with self.loop.lock:
            stats = self.worker_stats(prefill=counters)
            jobs = len({id(job) for job in self.jobs.values()})
        # A prefill runs until its KV is through: the ones still transferring count too.
        return dataclasses.replace(stats, load=dataclasses.replace(stats.load, running=jobs))

    def shutdown(self) -> None:
        super().shutdown()
        self.kv.close()

    # ---- engine loop side ---------------------------------------------------------------
    def _layer_hook(self, batch: ScheduledBatch):
        """For every prompt in this batch: ship each layer's newly complete blocks (a chunk's
        full blocks; at the last chunk, the rest) once the layer is done, layers gathered
        into bursts of at least ``kv.layer_burst_bytes`` (a long prompt's layers go one by
        one, a short one's in a few sends)."""
        shipping = []
        finishes = []
        block_size = self.engine.cache.block_size
        for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
            job = self.jobs.get(seq.request_id)
            if job is None or job.error is not None:
                continue
            if job.scheduled is None:
                job.scheduled = time.monotonic()
            end = seq.num_computed_tokens + count
            # full blocks; at the last chunk the partial tail block too
            upto = -(-end // block_size) if end == seq.num_tokens else end // block_size
            if upto > job.blocks_sent and not job.sources_free:
                table = seq.block_table[job.blocks_sent : upto]
                if job.stream.reads_in_place:  # read after this step: keep them as they are
                    job.held_blocks += self.engine.block_manager.fork(table)
                blocks = torch.tensor(table, dtype=torch.int64, device=self.engine.device)
                shipping.append((job, blocks, job.blocks_sent))
                job.blocks_sent = upto
            if end == seq.num_tokens:
                finishes.append(job.request_id)
        if not shipping:
            return None
        cache = self.engine.cache
        block_bytes = cache.bytes_per_block() // cache.num_layers  # one layer's K and V
        layer_bytes = block_bytes * sum(len(blocks) for _, blocks, _ in shipping)
        last_layer = cache.num_layers - 1
        ready: list[int] = []  # finished layers not sent yet

        def send(first_layer: int, layer_count: int) -> None:
            for job, blocks, first_block in shipping:
                if job.error is not None:
                    continue
                try:
                    job.stream.send_layers(first_layer, layer_count, blocks, first_block)
                except Exception as err:  # the stream broke: fail this job, keep the batch going
                    job.error = f"{self.name}: KV transfer of {job.request_id} failed: {err}"

        def layer_done(layer: int) -> None:
            # In bursts of kv.layer_burst_bytes, the last at the step's last layer: the
            # blocks stay as they are until the step ends, so a later gather reads the same.
            ready.append(layer)
            if layer == last_layer or len(ready) * layer_bytes >= self.options.kv.layer_burst_bytes:
                send(ready[0], len(ready))  # consecutive layers: done in order, sent in order
                ready.clear()

        if self.tensor_parallel_size == 1:
            return layer_done
        ships = tuple(
            (job.request_id, tuple(blocks.tolist()), first) for job, blocks, first in shipping
        )
        return LayerCallbacks(layer_done, Shipment(ships, tuple(finishes)))

    def _free_sources(self, job: PrefillJob) -> None:
        """The job's stream reads its blocks no more: give back the references it held."""
        with self.loop.lock:
            held, job.held_blocks = job.held_blocks, []
            job.sources_free = True
            self.engine.block_manager.free(held)

    def _on_result(self, result: StepResult) -> None:
        for request_id, token, lp in result.new_tokens:
            job = self.jobs.get(request_id)
            if job is not None:
                job.first_tokens[request_id] = FirstToken(token, lp)
        for request_id, entries in result.prompt_logprobs.items():
            job = self.jobs.get(request_id)
            if job is not None and job.prompt_logprobs is None:
                job.prompt_logprobs = tuple(entries)
        for output in result.finished:
            job = self.jobs.pop(output.request_id, None)
            if job is None:
                continue
            job.unfinished.discard(output.request_id)
            if not job.unfinished:
                job.num_cached_tokens = output.num_cached_tokens
                job.computed = time.monotonic()
                job.done.set()

    def _fail_all(self, err: Exception) -> None:
        for request_id in self.engine.request_ids():
            self.engine.abort(request_id)
            job = self.jobs.pop(request_id, None)
            if job is not None:
                job.stream.abort(str(err))
                self._abort_ranks(job.request_id, str(err))
                job.error = f"{self.name}: prefill step failed: {err}"
                job.done.set()
