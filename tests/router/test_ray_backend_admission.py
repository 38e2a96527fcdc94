"""RayBackend's admission against fake actors (no Ray): first come first served for decode
capacity, early 429 from SLO-aware admission, and retries of admitted requests let through."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.kv_events import KVCursor, KVEvents
from engine.load import EngineLoad
from engine.sampling_params import SamplingParams
from engine.tokenizer import ByteTokenizer
from kv_transfer.connector import KVHandle
from kv_transfer.errors import NoCapacityError
from router.admission import SLOTargets
from router.backend import GenerateRequest, Overloaded, RequestRejected
from router.config import RouterLimits
from router.ray_backend import RayBackend
from router.timeline import RequestTimeline
from workers.messages import FirstToken, PrefillResult, Reservation, TokenBatch, WorkerStats


class _Method:
    """``handle.method.remote(...)`` returning an awaitable, as a Ray actor handle does."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return asyncio.ensure_future(self.fn(*args, **kwargs))  # runs even if never awaited


async def _no_kv_events(since: KVCursor | None = None) -> KVEvents:
    return KVEvents(KVCursor("fake", 0), snapshot=True)  # a prefix cache holding nothing


class FakeDecode:
    """Takes ``capacity`` requests at once; each emits one token per poll once prefilled."""

    def __init__(self, capacity: int, reserve_s: float = 0.0) -> None:
        self.capacity = capacity
        self.reserve_s = reserve_s  # how long a reservation call takes
        self.reserving = self.most_reserving = 0  # calls in progress at once
        self.reserved: list[str] = []  # reservation order
        self.left: dict[str, int] = {}  # request → tokens still to emit
        self.prefilled: set[str] = set()
        self.reserve = _Method(self._reserve)
        self.poll = _Method(self._poll)
        self.cancel = _Method(self._cancel)
        self.stats = _Method(self._stats)
        self.kv_events = _Method(_no_kv_events)

    async def _reserve(
        self, rid: str, prompt: list[int], params: SamplingParams, forks=(), local_prefill_limit=0
    ) -> dict:
        self.reserving += 1
        self.most_reserving = max(self.most_reserving, self.reserving)
        try:
            await asyncio.sleep(self.reserve_s)
        finally:
            self.reserving -= 1
        if len(self.left) >= self.capacity:
            raise NoCapacityError("full")
        self.reserved.append(rid)
        self.left[rid] = params.max_tokens
        return Reservation(KVHandle("grpc", rid, "fake:0"))

    async def _poll(self, timeout_s: float) -> dict:
        await asyncio.sleep(0.005)
        out = {}
        for rid in [r for r in self.left if r in self.prefilled]:
            self.left[rid] -= 1
            done = self.left[rid] == 0
            out[rid] = TokenBatch(token_ids=(65,), finish_reason="length" if done else None)
            if done:
                del self.left[rid]
        return out

    async def _cancel(self, rid: str) -> bool:
        return self.left.pop(rid, None) is not None

    async def _stats(self) -> WorkerStats:
        load = EngineLoad(running=len(self.left), free_blocks=1000, max_num_seqs=self.capacity)
        return WorkerStats("decode-0", load)


class FakePrefill:
    def __init__(self, decode: FakeDecode) -> None:
        self.decode = decode
        self.prefill = _Method(self._prefill)
        self.cancel = _Method(self._cancel)
        self.stats = _Method(self._stats)
        self.kv_events = _Method(_no_kv_events)

    async def _prefill(self, rid, prompt, params, reservation, forks=()) -> PrefillResult:
        await asyncio.sleep(0.001)
        self.decode.prefilled.add(rid)
        return PrefillResult(first_tokens=(FirstToken(65),), transferred=False)

    async def _cancel(self, rid: str) -> bool:
        return False

    async def _stats(self) -> WorkerStats:
        return WorkerStats("prefill-0")


def make_backend(
    capacity: int,
    slo: SLOTargets | None = None,
    kv_cache_tokens: int | None = None,
    reserve_s: float = 0.0,
) -> tuple[RayBackend, FakeDecode]:
    backend = RayBackend(
        model_name="fake",
        tokenizer=ByteTokenizer(),
        max_model_len=512,
        vocab_size=256,
        block_size=16,
        limits=RouterLimits(queue_timeout_s=5.0),
        slo=slo,
        kv_cache_tokens=kv_cache_tokens,
    )
    decode = FakeDecode(capacity, reserve_s)
    backend.add_replica("decode-0", "decode", decode)
    backend.add_replica("prefill-0", "prefill", FakePrefill(decode))
    return backend, decode


def request(rid: str, max_tokens: int = 3) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return GenerateRequest(rid, [1, 2, 3], params, time.monotonic())


async def drain(backend: RayBackend, req: GenerateRequest) -> list[int]:
    tokens = []
    async for delta in backend.generate(req):
        tokens.extend(delta.token_ids)
    return tokens


def test_requests_waiting_for_capacity_are_served_first_come_first_served():
    async def run():
        backend, decode = make_backend(capacity=1)
        await backend.start()
        tasks = []
        for i in range(4):
            tasks.append(asyncio.create_task(drain(backend, request(f"r{i}", max_tokens=20))))
            await asyncio.sleep(0.01)  # arrival order r0, r1, ...; r0 holds the one slot
        # Capacity frees on the worker's own account (the router hears of it only when it
        # next asks): a newcomer must still queue behind r1..r3, not take it first.
        decode.capacity = 2
        tasks.append(asyncio.create_task(drain(backend, request("late", max_tokens=20))))
        outputs = await asyncio.gather(*tasks)
        await backend.stop()
        return decode.reserved, outputs, backend.waiting

    reserved, outputs, waiting = asyncio.run(run())
    assert reserved == ["r0#0", "r1#0", "r2#0", "r3#0", "late#0"]
    assert all(len(tokens) == 20 for tokens in outputs)
    assert waiting == 0


def test_the_front_of_the_line_reserves_side_by_side_until_it_finds_no_capacity():
    from router import decode_line

    async def run():
        backend, decode = make_backend(capacity=12, reserve_s=0.1)
        await backend.start()
        started = time.monotonic()
        burst = [asyncio.create_task(drain(backend, request(f"r{i}", 50))) for i in range(16)]
        while len(decode.reserved) < 12:
            await asyncio.sleep(0.005)
        twelve_in_s = time.monotonic() - started
        await asyncio.sleep(0.3)  # 4 left in line, the pool full: only the head retries
        most_while_full = decode.reserving
        outputs = await asyncio.gather(*burst)
        await backend.stop()
        return twelve_in_s, decode, most_while_full, outputs, backend

    twelve_in_s, decode, most_while_full, outputs, backend = asyncio.run(run())
    # 8 calls at once: 12 reservations of 0.1 s each take two rounds, not 1.2 s.
    assert decode.most_reserving == decode_line.PARALLEL_RESERVATIONS
    assert twelve_in_s < 0.6
    assert most_while_full <= 1
    assert sorted(decode.reserved) == sorted(f"r{i}#0" for i in range(16))
    assert all(len(tokens) == 50 for tokens in outputs)
    assert backend.replicas.by_name["decode-0"].in_flight == 0


def test_slo_admission_refuses_at_once_when_every_slot_is_taken_and_none_frees():
    async def run():
        backend, decode = make_backend(capacity=8, slo=SLOTargets(ttft_ms=500, tpot_ms=1000))
        await backend.start()
        backend.admission.slot_limits["decode-0"].limit = 1  # as if TPOT had been seen over target
        # It holds the only slot, and at its pace (a token per 5 ms poll) it ends in ~2 s.
        long = asyncio.create_task(drain(backend, request("long", max_tokens=400)))
        for _ in range(200):  # until its pace is known
            if backend.admission.decode_progress.slot_ends_s({"decode-0"}, time.monotonic()):
                break
            await asyncio.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(Overloaded) as refused:
            await drain(backend, request("new"))
        refused_after_s = time.monotonic() - started
        # A retry of an admitted request is not refused and ignores the slot limit.
        moved = request("moved")
        timeline = RequestTimeline(moved.arrival_time)
        replica, _ = await backend.attempts.reserve(
            moved, "moved#1", admitted=True, timeline=timeline
        )
        stats = backend.stats()
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
        await backend.stop()
        return refused.value, refused_after_s, replica.name, stats

    err, refused_after_s, replica, stats = asyncio.run(run())
    assert refused_after_s < 0.05  # early: no waiting for a slot first
    assert "waiting for decode" in str(err) and "under the 500 ms TTFT target" in str(err)
    assert 1.0 <= err.retry_after_s <= 10.0  # once the excess wait has passed: never minutes
    assert replica == "decode-0"
    assert stats["slo_refusals_total"] == 1 and stats["slot_limit"] == {"decode-0": 1}


def test_a_stale_forecast_error_cannot_refuse_everything_a_probe_gets_through(monkeypatch):
    from router import slo_admission

    monkeypatch.setattr(slo_admission, "PROBE_INTERVAL_S", 0.2)

    async def run():
        backend, _ = make_backend(capacity=8, slo=SLOTargets(ttft_ms=500, tpot_ms=1000))
        await backend.start()
        for _ in range(20):  # a bad stretch: every request ran 5 s over its forecast
            backend.admission.ttft_forecast.observe(time.monotonic(), 0.0, 5.0)
        backend.admission.prefill_backlog_tokens = 10  # a prompt ahead: the cluster is not idle
        outcomes = []
        for name in ("probe", "refused", "after"):
            if name == "after":
                await asyncio.sleep(0.25)
            try:
                outcomes.append(len(await drain(backend, request(name))))
            except Overloaded as err:
                outcomes.append(str(err))
        await backend.stop()
        return outcomes

    probe, refused, after = asyncio.run(run())
    assert probe == 3  # nothing admitted lately and its queues say it is fast: let in
    assert "recent forecast error 5000 ms" in refused  # right after, the error rules
    assert after == 3  # a probe interval later, another one gets through


def test_an_idle_cluster_never_refuses_whatever_the_forecast_says():
    """Nothing ahead of a request: its forecast is its own prefill (even one longer than the
    target), which refusing it would not shorten."""

    async def run():
        backend, _ = make_backend(capacity=8, slo=SLOTargets(ttft_ms=500, tpot_ms=1000))
        await backend.start()
        for _ in range(20):
            backend.admission.ttft_forecast.observe(time.monotonic(), 0.0, 5.0)  # 5 s late each
        backend.admission._last_admission = time.monotonic()  # and no probe due
        served = [len(await drain(backend, request(f"r{i}"))) for i in range(3)]
        backend.admission.prefill_backlog_tokens = 10  # one prompt ahead: now the forecast rules
        with pytest.raises(Overloaded, match="forecast error 5000 ms"):
            await drain(backend, request("behind"))
        await backend.stop()
        return served

    assert asyncio.run(run()) == [3, 3, 3]


def test_a_request_that_can_never_fit_is_rejected_before_admission_can_refuse_it():
    async def run():
        backend, decode = make_backend(
            capacity=8, slo=SLOTargets(ttft_ms=500, tpot_ms=1000), kv_cache_tokens=64
        )
        await backend.start()
        for _ in range(20):  # under load: SLO admission would refuse a new request
            backend.admission.ttft_forecast.observe(time.monotonic(), 0.0, 5.0)
        backend.admission._last_admission = time.monotonic()
        backend.admission.prefill_backlog_tokens = 10
        with pytest.raises(RequestRejected) as rejected:
            await drain(backend, request("huge", max_tokens=100))  # 3 + 100 > 64 tokens
        await backend.stop()
        return str(rejected.value), decode.reserved

    message, reserved = asyncio.run(run())
    assert "needs up to 103 tokens of KV cache but the cache holds 64" in message
    assert reserved == []  # no worker saw it
