"""The host KV tier: copies bit for bit, evicted prefix blocks served again from host memory,
the KV events that say where a block is, swap-out and swap-in on preemption, and an engine
with a small cache and a tier giving the same greedy tokens as one with a big cache."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.host_kv_tier import HostKVTier
from engine.kv_cache import PagedKVCache
from engine.kv_events import KVEvents
from engine.llm_engine import LLMEngine
from engine.prefix_hash import block_hashes
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.tiny import TINY_CONFIG
from tests.engine.checkpoints import make_checkpoint

BLOCK = 8
SHAPE = dataclasses.replace(TINY_CONFIG, num_layers=3, num_kv_heads=2, head_dim=16)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def make_cache(num_blocks: int, dtype: torch.dtype = torch.float32) -> PagedKVCache:
    cache = PagedKVCache(SHAPE, num_blocks, BLOCK, dtype, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for tensor in cache.tensors():  # every byte distinct-ish, scales too
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    return cache


def block_bytes(cache: PagedKVCache, block_id: int) -> list[torch.Tensor]:
    return [t[:, block_id].clone().view(torch.uint8) for t in cache.tensors()]


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def compute(bm: BlockManager, prompt: list[int]) -> list[int]:
    """What the scheduler and runner do for a prompt: allocate, compute, publish, free;
    returns the table it had."""
    table, _ = bm.allocate(prompt)
    bm.register_full_blocks(table, prompt, len(prompt))
    used = list(table)
    bm.free(table)
    return used


# ---- the tier's copies ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_copies_round_trip_bit_exact(dtype):
    cache = make_cache(6, dtype)
    assert len(cache.tensors()) == (4 if dtype == torch.float8_e4m3fn else 2)
    tier = HostKVTier(cache, 4)
    originals = {b: block_bytes(cache, b) for b in (1, 4)}
    assert tier.store([(1, 111, (1,) * BLOCK), (4, 444, (4,) * BLOCK)]) == []
    slots = [tier.peek(111, (1,) * BLOCK), tier.peek(444, (4,) * BLOCK)]
    assert None not in slots and tier.peek(111, (2,) * BLOCK) is None  # tokens checked
    tier.move_in(slots, [0, 5])
    assert same_bytes(block_bytes(cache, 0), originals[1])
    assert same_bytes(block_bytes(cache, 5), originals[4])
    assert not tier.holds(111) and not tier.holds(444)  # exclusive: loaded, gone from host
    # pinned: a swap-out and back into other blocks
    swapped, dropped = tier.swap_out([2, 3])
    before = [block_bytes(cache, 2), block_bytes(cache, 3)]
    tier.move_in(swapped, [1, 4])
    assert dropped == [] and same_bytes(block_bytes(cache, 1), before[0])
    assert same_bytes(block_bytes(cache, 4), before[1])
    stats = tier.stats()
    assert (stats.offloads, stats.loads, stats.cached_slots, stats.pinned_slots) == (4, 4, 0, 0)
    assert tier.room() == 4
    assert stats.offload_s_per_block > 0 and stats.load_s_per_block > 0
    assert tier.copy_cost_s(10) == pytest.approx(
        10 * (stats.offload_s_per_block + stats.load_s_per_block)
    )


def test_a_full_tier_drops_its_oldest_cached_block_never_a_pinned_one():
    tier = HostKVTier(make_cache(8), 3)
    tier.store([(0, 10, ()), (1, 11, ())])
    assert tier.store([(0, 10, ())]) == []  # held already: refreshed, 11 is now the oldest
    pinned, dropped = tier.swap_out([2])
    assert dropped == [] and tier.room() == 2
    assert tier.store([(3, 13, ())]) == [11]
    assert tier.store([(4, 14, ())]) == [10]
    assert tier.holds(13) and tier.holds(14) and not tier.holds(10)
    with pytest.raises(EngineError, match="host KV tier full"):
        tier.swap_out([5, 6, 7])
    all_pinned, _ = tier.swap_out([5, 6])
    assert tier.room() == 0 and tier.store([(7, 17, ())]) == [] and not tier.holds(17)
    tier.release(pinned + all_pinned)
    with pytest.raises(EngineError, match="not pinned"):
        tier.release(pinned)
    with pytest.raises(EngineError, match="neither cached nor pinned"):
        tier.move_in(pinned, [0])


def test_a_load_into_an_evicted_block_exchanges_the_two():
    cache = make_cache(4)
    tier = HostKVTier(cache, 2)
    tier.store([(0, 10, (1,)), (1, 11, (2,))])
    held = [block_bytes(cache, 0), block_bytes(cache, 1)]
    evicted = [block_bytes(cache, 2), block_bytes(cache, 3)]
    slots = [tier.peek(10, (1,)), tier.peek(11, (2,))]
    tier.move_in(slots, [2, 3], [(12, (3,)), None])  # block 2's own cached contents leave
    assert same_bytes(block_bytes(cache, 2), held[0]) and same_bytes(block_bytes(cache, 3), held[1])
    assert tier.holds(12) and not tier.holds(10) and not tier.holds(11)
    tier.move_in([tier.peek(12, (3,))], [0])
    assert same_bytes(block_bytes(cache, 0), evicted[0]) and tier.stats().dropped == 0


# ---- the block manager over the tier ----------------------------------------------------
def test_an_evicted_prefix_is_served_from_host_with_the_same_bytes():
    cache = make_cache(4)
    bm = BlockManager(4, BLOCK, host_tier=HostKVTier(cache, 8))
    prompt = list(range(100, 100 + 2 * BLOCK + 3))  # 2 full blocks and 3 tokens
    first = compute(bm, prompt)
    contents = [block_bytes(cache, b) for b in first[:2]]
    compute(bm, list(range(500, 500 + 4 * BLOCK)))  # every block: the prompt's go to host
    assert bm.host_tier.stats().offloads == 2
    for tensor in cache.tensors():  # the device blocks are overwritten since
        tensor.zero_()
    assert bm.can_allocate(prompt)
    table, cached = bm.allocate(prompt)
    assert cached == 2 * BLOCK and bm.prefix_hit_tokens == 2 * BLOCK
    assert bm.host_hit_tokens == 2 * BLOCK
    for block_id, expected in zip(table[:2], contents, strict=True):
        assert same_bytes(block_bytes(cache, block_id), expected)
    # published on the device again: the next prompt hits there, not in the host tier
    bm.register_full_blocks(table, prompt, len(prompt))
    again, cached = bm.allocate(prompt)
    assert again[:2] == table[:2] and cached == 2 * BLOCK and bm.host_hit_tokens == 2 * BLOCK
    assert bm.host_tier.stats().loads == 2
    assert not any(bm.host_tier.holds(h) for h in block_hashes(prompt, BLOCK))  # exclusive
    bm.free(again)
    bm.free(table)
    assert bm.num_used_blocks == 0


def test_hits_loaded_into_a_full_device_drop_nothing_from_a_full_tier():
    cache = make_cache(4)
    bm = BlockManager(4, BLOCK, host_tier=HostKVTier(cache, 3))
    a = list(range(3 * BLOCK + 1))  # 3 cached blocks and a partial one: the whole pool
    b = list(range(500, 500 + 3 * BLOCK + 1))
    a_table = compute(bm, a)
    a_contents = [block_bytes(cache, x) for x in a_table[:3]]
    b_table = compute(bm, b)  # a's 3 blocks fill the tier
    b_contents = [block_bytes(cache, x) for x in b_table[:3]]
    table, cached = bm.allocate(a)  # a's hits evict b's 3 blocks: they take a's slots
    assert cached == 3 * BLOCK and bm.host_tier.stats().dropped == 0
    for block_id, expected in zip(table[:3], a_contents, strict=True):
        assert same_bytes(block_bytes(cache, block_id), expected)
    bm.register_full_blocks(table, a, len(a))
    bm.free(table)
    table, cached = bm.allocate(b)  # and back: b's from the tier, a's to it
    assert cached == 3 * BLOCK and bm.host_hit_tokens == 6 * BLOCK
    for block_id, expected in zip(table[:3], b_contents, strict=True):
        assert same_bytes(block_bytes(cache, block_id), expected)
    assert bm.host_tier.stats().dropped == 0


def test_host_hits_need_fresh_device_blocks():
    cache = make_cache(4)
    bm = BlockManager(4, BLOCK, host_tier=HostKVTier(cache, 8))
    prompt = list(range(3 * BLOCK + 1))  # 3 full blocks hit, 1 block computed
    compute(bm, prompt)
    compute(bm, list(range(500, 500 + 4 * BLOCK)))  # prompt's 3 blocks to host
    held, _ = bm.allocate(list(range(900, 901)))  # one block taken: 3 left of 4 needed
    assert not bm.can_allocate(prompt)
    with pytest.raises(EngineError, match="KV cache full"):
        bm.allocate(prompt)
    bm.free(held)
    assert bm.can_allocate(prompt)
    table, cached = bm.allocate(prompt)
    assert cached == 3 * BLOCK and bm.host_hit_tokens == 3 * BLOCK and len(table) == 4


def test_without_a_tier_nothing_changes():
    bm = BlockManager(4, BLOCK)
    prompt = list(range(2 * BLOCK + 1))
    cursor = bm.events.since(None).cursor
    compute(bm, prompt)
    compute(bm, list(range(500, 500 + 4 * BLOCK)))
    _, cached = bm.allocate(prompt)
    assert cached == 0 and bm.host_hit_tokens == 0
    events = bm.events.since(cursor)
    assert events.offloaded == () and set(block_hashes(prompt, BLOCK)) <= set(events.removed)


# ---- KV events ----------------------------------------------------------------------------
def test_events_say_offloaded_for_device_to_host_and_removed_for_dropped():
    cache = make_cache(4)
    bm = BlockManager(4, BLOCK, host_tier=HostKVTier(cache, 2))
    a = list(range(2 * BLOCK + 1))
    a_hashes = block_hashes(a, BLOCK)
    start = bm.events.since(None).cursor
    compute(bm, a)
    stored = bm.events.since(start)
    assert stored.stored == tuple(a_hashes) and stored.offloaded == () == stored.removed
    b = list(range(500, 500 + 4 * BLOCK))
    b_hashes = block_hashes(b, BLOCK)
    compute(bm, b)  # a's blocks move to the host
    moved = bm.events.since(stored.cursor)
    assert set(moved.offloaded) == set(a_hashes) and not set(moved.removed) & set(a_hashes)
    assert set(moved.stored) == set(b_hashes)
    snapshot = bm.events.since(None)
    assert snapshot.snapshot and set(snapshot.stored) == set(b_hashes)
    assert set(snapshot.offloaded) == set(a_hashes)
    c = list(range(900, 900 + 4 * BLOCK))
    # b's blocks go to the host, its tail first (freed last block first): the full tier
    # drops a's, then b's tail, and keeps b's first two
    compute(bm, c)
    later = bm.events.since(moved.cursor)
    assert set(later.removed) == set(a_hashes) | set(b_hashes[2:])
    assert set(later.offloaded) == set(b_hashes[:2])
    # a host hit loaded back reads as stored
    bm.allocate(b[: 2 * BLOCK + 1])
    back = bm.events.since(later.cursor)
    assert set(back.stored) >= set(b_hashes[:2]) and not set(back.offloaded) & set(b_hashes[:2])
    assert pickle.loads(pickle.dumps(back)) == back
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.offloaded = ()  # type: ignore[misc]
    assert KVEvents(back.cursor).offloaded == ()


# ---- swap on preemption -------------------------------------------------------------------
def running_sequence(scheduler: Scheduler, prompt_len: int, generated: int = 1) -> Sequence:
    """A sequence whose prompt and first ``generated - 1`` outputs are computed, decoding."""
    bm = scheduler.block_manager
    seq = Sequence(prompt_token_ids=list(range(10, 10 + prompt_len)), params=GREEDY)
    seq.block_table, _ = bm.allocate(seq.token_ids)
    seq.token_ids += list(range(200, 200 + generated))
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.num_registered_blocks = bm.register_full_blocks(
        seq.block_table, seq.token_ids, seq.num_computed_tokens
    )
    scheduler.running.append(seq)
    return seq


def test_a_swapped_sequence_comes_back_with_its_blocks_and_no_recompute():
    cache = make_cache(8)
    bm = BlockManager(8, BLOCK, host_tier=HostKVTier(cache, 8))
    scheduler = Scheduler(bm, 8, 64, preemption_mode="swap")
    seq = running_sequence(scheduler, 2 * BLOCK + 2, generated=3)  # 20 computed: 3 blocks
    contents = [block_bytes(cache, b) for b in seq.block_table[:3]]
    scheduler.preempt(seq)
    assert len(seq.swapped_slots) == 3 and seq.block_table == []
    assert seq.num_computed_tokens == 2 * BLOCK + 4 and bm.num_used_blocks == 0
    assert (scheduler.num_swaps_out, scheduler.num_recomputes) == (1, 0)
    for tensor in cache.tensors():
        tensor.zero_()
    batch = scheduler.schedule()
    assert batch.seqs == [seq] and batch.num_new_tokens == [1]  # just its next token
    assert scheduler.num_swaps_in == 1 and seq.swapped_slots == []
    for block_id, expected in zip(seq.block_table[:3], contents, strict=True):
        assert same_bytes(block_bytes(cache, block_id), expected)
    assert bm.host_tier.stats().pinned_slots == 0


def test_a_sequence_aborted_while_swapped_frees_its_slots():
    bm = BlockManager(8, BLOCK, host_tier=HostKVTier(make_cache(8), 8))
    scheduler = Scheduler(bm, 8, 64, preemption_mode="swap")
    seq = running_sequence(scheduler, 2 * BLOCK)
    scheduler.preempt(seq)
    assert bm.host_tier.stats().pinned_slots == 2
    scheduler.finish(seq, "abort")
    assert bm.host_tier.stats().pinned_slots == 0 and not scheduler.has_unfinished()


def test_a_fork_sharing_blocks_is_recomputed():
    bm = BlockManager(8, BLOCK, host_tier=HostKVTier(make_cache(8), 8))
    scheduler = Scheduler(bm, 8, 64, preemption_mode="swap")
    seq = running_sequence(scheduler, 2 * BLOCK)
    sibling = bm.fork(seq.block_table)
    scheduler.preempt(seq)
    assert seq.swapped_slots == [] and seq.num_computed_tokens == 0
    assert (scheduler.num_swaps_out, scheduler.num_recomputes) == (0, 1)
    bm.free(sibling)


def test_auto_swaps_only_where_the_measured_copies_cost_less():
    tier = HostKVTier(make_cache(8), 8)
    bm = BlockManager(8, BLOCK, host_tier=tier)
    per_token: list[float | None] = [None]
    scheduler = Scheduler(bm, 8, 64, prefill_token_s=lambda: per_token[0])
    seq = running_sequence(scheduler, 2 * BLOCK)
    assert not scheduler.should_swap(seq)  # nothing measured
    tier.move_in(tier.swap_out([7])[0], [7])  # one copy each way, measured
    assert not scheduler.should_swap(seq)  # still no prefill measured
    copy_s = tier.copy_cost_s(2)
    per_token[0] = 10 * copy_s / seq.num_computed_tokens  # recompute 10x the copies
    assert scheduler.should_swap(seq)
    per_token[0] = 0.1 * copy_s / seq.num_computed_tokens
    assert not scheduler.should_swap(seq)
    assert not Scheduler(bm, 8, 64, preemption_mode="recompute").should_swap(seq)


# ---- config -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"host_kv_cache_gb": -1.0}, "host_kv_cache_gb must be a number >= 0"),
        ({"host_kv_cache_gb": "4"}, "host_kv_cache_gb must be a number >= 0"),
        ({"num_host_kv_blocks": 0}, "num_host_kv_blocks must be a positive integer"),
        ({"preemption_mode": "spill"}, "preemption_mode must be auto, recompute or swap"),
        ({"preemption_mode": "swap"}, "preemption_mode swap needs a host KV tier"),
        (
            {"host_kv_cache_gb": 1.0, "tensor_parallel_size": 2},
            "the host KV tier does not support tensor_parallel_size > 1 yet",
        ),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(EngineError, match=match):
        EngineConfig(**kwargs)


def test_config_sizes_the_tier():
    assert EngineConfig().host_blocks_for(1000) == 0 and not EngineConfig().wants_host_tier
    assert EngineConfig(host_kv_cache_gb=1.0).host_blocks_for(2**20) == 1024
    assert EngineConfig(host_kv_cache_gb=1.0, num_host_kv_blocks=7).host_blocks_for(2**20) == 7


# ---- the engine: exact tokens through evictions, host hits and swaps ----------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-host-tier")
    make_checkpoint(directory, "llama")
    return directory


def run_one_by_one(engine: LLMEngine, prompts, params) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        seq = engine.add_request(prompt, params)
        tokens = None
        while tokens is None:
            for output in engine.step().finished:
                assert output.request_id == seq.request_id
                tokens = output.token_ids
        outputs.append(tokens)
    return outputs


def run_batch(engine: LLMEngine, prompts, params) -> list[list[int]]:
    ids = [engine.add_request(p, params).request_id for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step().finished:
            done[output.request_id] = output.token_ids
    return [done[i] for i in ids]


def test_small_cache_with_a_host_tier_gives_the_big_caches_tokens(llama_dir):
    # 4 documents of 4 blocks, each asked 3 questions round-robin: 16 blocks of prefixes,
    # plus each request's own, against a device cache of 16 blocks
    documents = [[1] + [(d * 53 + i * 7) % 250 + 3 for i in range(4 * BLOCK - 1)] for d in range(4)]
    questions = [[(q * 31 + i * 13) % 250 + 3 for i in range(5)] for q in range(3)]
    asked = [doc + question for question in questions for doc in documents]
    asked.append(documents[-1] + [7, 8, 9])  # right after its document: device hits
    # a batch whose sequences outgrow the cache together: preemption, swapped out and in
    batch = [[1] + [(b * 17 + i * 3) % 250 + 3 for i in range(19)] for b in range(6)]
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    big = LLMEngine(llama_dir, EngineConfig(dtype="float32", num_kv_blocks=512), progress=False)
    expected_asked = run_one_by_one(big, asked, short)
    expected_batch = run_one_by_one(big, batch, long)
    assert big.load().host_blocks == 0 and big.load().swaps_out == 0

    config = EngineConfig(
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=16,
        num_host_kv_blocks=48,
        preemption_mode="swap",
    )
    small = LLMEngine(llama_dir, config, progress=False)
    assert run_one_by_one(small, asked, short) == expected_asked
    load = small.load()
    assert load.host_hit_tokens > 0 and load.host_offloads > 0 and load.host_loads > 0
    assert load.prefix_hit_tokens > load.host_hit_tokens  # device hits too
    assert run_batch(small, batch, long) == expected_batch
    load = small.load()
    assert load.swaps_out > 0 and load.swaps_in == load.swaps_out
    assert load.preemptions == load.swaps_out + load.recomputes
    assert load.host_blocks == 48 and load.free_blocks == 16
    assert small.host_tier.stats().pinned_slots == 0
