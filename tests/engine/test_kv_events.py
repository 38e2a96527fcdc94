"""The prefix cache's block names and its event log: the router's hash of a prompt equals the
engine's, in any process; the log reports what was stored and evicted, and answers a stale or
foreign cursor with a snapshot."""

from __future__ import annotations

import subprocess
import sys

from engine.block_manager import BlockManager
from engine.kv_events import KVCursor
from engine.prefix_hash import block_hashes, chain_hash

BLOCK = 4


def _compute(bm: BlockManager, prompt: list[int]) -> list[int]:
    """What the scheduler and runner do for a prompt: allocate, compute, publish, free."""
    table, _ = bm.allocate(prompt)
    bm.register_full_blocks(table, prompt, len(prompt))
    hashes = [bm.blocks[b].hash for b in table if bm.blocks[b].hash is not None]
    bm.free(table)
    return hashes


def test_the_routers_hash_of_a_prompt_is_the_engines():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    prompt = list(range(100, 114))  # 3 full blocks and 2 tokens
    assert _compute(bm, prompt) == block_hashes(prompt, BLOCK)
    assert len(block_hashes(prompt, BLOCK)) == 3
    # what the router looks up: the blocks the cache may serve (never the last token's)
    assert block_hashes(prompt[:12], BLOCK, 11) == block_hashes(prompt, BLOCK)[:2]
    # a chain: the same block after another prefix is another block
    assert chain_hash(None, [1, 2, 3, 4]) != chain_hash(chain_hash(None, [9] * 4), [1, 2, 3, 4])


def test_the_hash_is_the_same_in_another_interpreter_whatever_its_hash_seed():
    prompt = [7, 300000, 5, 49151, 0, 1, 2, 3]
    code = f"from engine.prefix_hash import block_hashes;print(block_hashes({prompt!r}, {BLOCK}))"
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=sys.path[0] or ".",
        )
        assert out.stdout.strip() == str(block_hashes(prompt, BLOCK))


def test_events_report_stored_and_evicted_blocks_by_their_state_now():
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    first = bm.events.since(None)
    assert first.snapshot and first.stored == ()
    a = _compute(bm, list(range(9)))  # 2 full blocks
    events = bm.events.since(first.cursor)
    assert not events.snapshot and events.stored == tuple(a) and events.removed == ()
    # a different prompt needing every block evicts a's cached blocks
    b = _compute(bm, list(range(50, 66)))  # 4 full blocks: all of the pool
    later = bm.events.since(events.cursor)
    assert set(later.removed) == set(a)
    assert set(later.stored) == set(b[:3]) | ({b[3]} if b[3] not in a else set())
    # nothing new: nothing reported
    assert bm.events.since(later.cursor).stored == () == bm.events.since(later.cursor).removed
    # an old cursor sees each hash once, as it is now
    again = bm.events.since(events.cursor)
    assert set(again.removed) == set(a) and set(again.stored) == set(b)


def test_a_stale_or_foreign_cursor_gets_a_snapshot_of_everything_held():
    bm = BlockManager(num_blocks=2, block_size=BLOCK)
    start = bm.events.since(None).cursor
    for offset in range(0, 400, 8):  # far more touches than the log keeps (4 per block)
        _compute(bm, list(range(offset, offset + 8)))
    held = set(bm._cached)
    stale = bm.events.since(start)
    assert stale.snapshot and set(stale.stored) == held
    foreign = bm.events.since(KVCursor("another engine", start.position))
    assert foreign.snapshot and set(foreign.stored) == held


def test_prefix_queries_and_hits_count_tokens_looked_up_and_found():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    prompt = list(range(13))
    _compute(bm, prompt)
    assert (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (13, 0)
    table, cached = bm.allocate(prompt)
    assert cached == 12 and (bm.prefix_query_tokens, bm.prefix_hit_tokens) == (26, 12)
    bm.free(table)
    table, _ = bm.allocate(prompt, use_cache=False)  # prompt logprobs: not a lookup
    assert bm.prefix_query_tokens == 26
