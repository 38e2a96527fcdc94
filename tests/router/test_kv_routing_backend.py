"""RayBackend with KV-aware routing against fake actors (no Ray) whose prefix caches are real
block managers: the router reads their KV events into its index, sends a prompt where its
prefix is cached, counts the choice, drops a drained or dead replica's entries, and the
last delta carries the prefill's cached tokens (OpenAI's usage.prompt_tokens_details)."""

from __future__ import annotations

import asyncio
import time

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from router.backend import GenerateRequest
from router.openai_format import ResponseFormat
from tests.router.test_ray_backend_admission import FakeDecode, FakePrefill, _Method, make_backend
from workers.messages import FirstToken, PrefillResult


class CachingPrefill(FakePrefill):
    """A prefill replica whose prefix cache is a real BlockManager (block size 16)."""

    def __init__(self, decode: FakeDecode) -> None:
        super().__init__(decode)
        self.bm = BlockManager(64, 16)
        self.prompts: list[list[int]] = []
        self.kv_events = _Method(self._kv_events)

    async def _prefill(self, rid, prompt, params, reservation, forks=()) -> PrefillResult:
        table, cached = self.bm.allocate(prompt)
        self.bm.register_full_blocks(table, prompt, len(prompt))
        self.bm.free(table)
        self.prompts.append(list(prompt))
        self.decode.prefilled.add(rid)
        return PrefillResult(first_tokens=(FirstToken(65),), num_cached_tokens=cached)

    async def _kv_events(self, since=None):
        return self.bm.events.since(since)


def _request(rid: str, prompt: list[int]) -> GenerateRequest:
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    return GenerateRequest(rid, prompt, params, time.monotonic())


def test_the_router_routes_by_its_replicas_kv_events_and_reports_cached_tokens():
    async def run():
        backend, decode = make_backend(capacity=8)
        first = CachingPrefill(decode)
        second = CachingPrefill(decode)
        backend.replicas.by_name["prefill-0"].handle = first
        backend.add_replica("prefill-1", "prefill", second)
        await backend.start()
        chat_a = list(range(1, 70))
        chat_b = list(range(500, 570))
        last = {}
        for rid, prompt in (("a1", chat_a), ("b1", chat_b)):
            deltas = [d async for d in backend.generate(_request(rid, prompt))]
            last[rid] = deltas[-1]
        await backend._refresh_stats()  # the stats loop's read, now
        homes = {tuple(p): "prefill-0" for p in first.prompts} | {
            tuple(p): "prefill-1" for p in second.prompts
        }
        assert homes[tuple(chat_a)] != homes[tuple(chat_b)]  # spread: equal cost, less cached
        for rid, prompt in (("a2", chat_a + [7] * 30), ("b2", chat_b + [8] * 30)):
            deltas = [d async for d in backend.generate(_request(rid, prompt))]
            last[rid] = deltas[-1]
        assert last["a1"].cached_tokens == 0 and last["a2"].cached_tokens == 64
        assert last["b2"].cached_tokens == 64  # each followed its prefix
        stats = backend.stats()
        assert stats["prefill_routing"].get("overlap") == 2
        assert stats["kv_index_blocks"]["prefill-0"] > 0
        backend.drain_replica(homes[tuple(chat_a)])
        assert stats["kv_index_blocks"][homes[tuple(chat_a)]] > 0
        assert backend.stats()["kv_index_blocks"][homes[tuple(chat_a)]] == 0
        await backend.stop()

    asyncio.run(run())


def test_usage_counts_each_prompts_cached_tokens_once_and_only_when_known():
    class Prep:
        def __init__(self, prompts, n):
            self.requests = [_request(f"r{i}", p) for p in prompts for i in range(n)]
            self.n = n

    two = Prep([[1] * 40, [2] * 20], n=2)
    usage = ResponseFormat.usage(two, 8, [32, 32, 16, 16])
    assert usage["prompt_tokens"] == 60 and usage["prompt_tokens_details"] == {"cached_tokens": 48}
    assert "prompt_tokens_details" not in ResponseFormat.usage(two, 8, [32, 32, None, None])
    assert "prompt_tokens_details" not in ResponseFormat.usage(two, 8)
    # a migrated request's last prompt held its streamed tokens: never more than the prompt
    one = Prep([[1] * 40], n=1)
    assert ResponseFormat.usage(one, 8, [48])["prompt_tokens_details"] == {"cached_tokens": 40}


def test_a_replica_removed_while_its_events_are_read_stays_out_of_the_index():
    class SlowEvents(CachingPrefill):
        async def _kv_events(self, since=None):
            await asyncio.sleep(0.2)
            return self.bm.events.since(since)

    async def run():
        backend, decode = make_backend(capacity=8)
        backend.replicas.by_name["prefill-0"].handle = SlowEvents(decode)
        reading = asyncio.create_task(backend._refresh_stats())
        await asyncio.sleep(0.05)
        backend.remove_replica("prefill-0")  # dead or drained meanwhile
        await reading
        return backend.kv_index.known("prefill-0")

    assert asyncio.run(run()) is False
