from __future__ import annotations

import pytest

from engine.block_manager import BlockManager, kv_cache_misfit
from engine.errors import EngineError


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=16)
    table, cached = bm.allocate(tokens(40))
    assert len(table) == 3 and cached == 0 and bm.num_free_blocks == 5
    bm.free(table)
    assert table == [] and bm.num_free_blocks == 8


def test_prefix_blocks_are_shared_and_reference_counted():
    bm = BlockManager(num_blocks=8, block_size=16)
    prompt = tokens(40)
    first, _ = bm.allocate(prompt)
    bm.register_full_blocks(first, prompt, len(prompt))
    second, cached = bm.allocate(prompt[:32] + [999] * 5)
    assert cached == 32 and second[:2] == first[:2] and second[2] != first[2]
    assert bm.blocks[first[0]].ref_count == 2
    shared = first[0]
    bm.free(first)
    assert bm.blocks[shared].ref_count == 1
    bm.free(second)
    assert bm.num_free_blocks == 8


def test_block_holding_the_last_token_is_never_reused():
    bm = BlockManager(num_blocks=8, block_size=16)
    prompt = tokens(32)  # exactly two full blocks
    table, _ = bm.allocate(prompt)
    bm.register_full_blocks(table, prompt, 32)
    again, cached = bm.allocate(prompt)
    assert cached == 16  # the second block is recomputed so the last logits exist
    assert again[0] == table[0] and again[1] != table[1]


def test_hash_chain_distinguishes_same_block_after_different_prefix():
    bm = BlockManager(num_blocks=8, block_size=16)
    a = tokens(16, 0) + tokens(16, 100) + [1]
    b = tokens(16, 50) + tokens(16, 100) + [1]
    ta, _ = bm.allocate(a)
    bm.register_full_blocks(ta, a, 33)
    _, cached = bm.allocate(b)
    assert cached == 0


def test_unreferenced_cached_blocks_are_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=16)
    old, new = tokens(17, 0), tokens(17, 500)
    t_old, _ = bm.allocate(old)
    bm.register_full_blocks(t_old, old, 16)
    bm.free(t_old)
    t_new, _ = bm.allocate(new)
    bm.register_full_blocks(t_new, new, 16)
    bm.free(t_new)
    assert bm.num_free_blocks == 4
    # Needs all 4 blocks: both cached prefixes get evicted, the older one first.
    big, cached = bm.allocate(tokens(64, 1000))
    assert cached == 0 and len(big) == 4
    bm.free(big)
    assert bm.allocate(old)[1] == 0  # its cached block is gone


def test_cached_block_still_hits_after_free_until_evicted():
    bm = BlockManager(num_blocks=4, block_size=16)
    prompt = tokens(20)
    table, _ = bm.allocate(prompt)
    bm.register_full_blocks(table, prompt, 20)
    bm.free(table)
    again, cached = bm.allocate(prompt)
    assert cached == 16 and bm.prefix_hit_tokens == 16


def test_full_pool_refuses_and_grow_reports_failure():
    bm = BlockManager(num_blocks=2, block_size=16)
    assert not bm.can_allocate(tokens(40))
    with pytest.raises(EngineError, match="KV cache full"):
        bm.allocate(tokens(40))
    table, _ = bm.allocate(tokens(20))
    assert not bm.grow(table, 40) and len(table) == 2
    assert bm.grow(table, 32)


def test_double_free_is_an_error():
    bm = BlockManager(num_blocks=2, block_size=16)
    table, _ = bm.allocate(tokens(4))
    copy = list(table)
    bm.free(table)
    with pytest.raises(EngineError):
        bm.free(copy)


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=16, enable_prefix_caching=False)
    prompt = tokens(40)
    table, _ = bm.allocate(prompt)
    bm.register_full_blocks(table, prompt, 40)
    assert bm.allocate(prompt)[1] == 0


def test_kv_cache_misfit_counts_whole_blocks_up_to_the_model_limit():
    # 4 blocks of 16 tokens: 60 prompt + 4 new = 64 fits, one more token does not.
    assert kv_cache_misfit(60, 4, 1024, 16, 4) is None
    assert kv_cache_misfit(60, 5, 1024, 16, 4) == (
        "request needs up to 65 tokens of KV cache but the cache holds 64"
    )
    assert kv_cache_misfit(60, 500, 64, 16, 4) is None  # never past max_model_len
