"""KV-aware prefill routing: the router's index of each replica's cached blocks (from real
block managers' events), and the choice it makes on it: a conversation stays where its
prefix is cached, a shared system prompt does not pull every request onto one replica, a
busy replica's cache is worth only what it saves, scale-up and replacement move only the
prefixes they must, and each choice is counted by its reason."""

from __future__ import annotations

import random

from engine.block_manager import BlockManager
from engine.prefix_hash import block_hashes
from router.kv_index import KVIndex
from router.prefill_routing import PrefillPolicy, choose_prefill
from router.replicas import Replica
from workers.pool import Pool

BLOCK = 16


class Engine:
    """A prefill replica's prefix cache (a real BlockManager) and the router's view of it."""

    def __init__(self, name: str, num_blocks: int = 256) -> None:
        self.replica = Replica(name, Pool.PREFILL, handle=None)
        self.bm = BlockManager(num_blocks, BLOCK)

    def prefill(self, prompt: list[int]) -> int:
        table, cached = self.bm.allocate(prompt)
        self.bm.register_full_blocks(table, prompt, len(prompt))
        self.bm.free(table)
        return cached

    def report(self, index: KVIndex) -> None:
        name = self.replica.name
        index.apply(name, self.bm.events.since(index.cursor(name)))


def route(policy, engines, index, prompt, now=0.0, predict=True):
    hashes = block_hashes(prompt, BLOCK, len(prompt) - 1)
    choice = choose_prefill(policy, [e.replica for e in engines], prompt, hashes, index, BLOCK, now)
    if predict:
        index.predict(choice.replica.name, hashes, now)
    return next(e for e in engines if e.replica is choice.replica), choice


def conversations(turns: int, count: int, system_len: int = 96, seed: int = 0):
    """``count`` chats sharing a system prompt; turn t's prompt extends turn t-1's."""
    rng = random.Random(seed)
    system = [rng.randrange(1000) for _ in range(system_len)]
    chats = [list(system) for _ in range(count)]
    for _ in range(turns):
        for chat in chats:
            chat.extend(rng.randrange(1000) for _ in range(40))
            yield chat
            chat.extend(rng.randrange(1000) for _ in range(24))  # the answer


def serve(policy, engines, rounds):
    """Each round's prompts arrive together: all routed (each replica's backlog counting
    what was routed to it), then prefilled, then the index reads the engines' events."""
    index = KVIndex()
    cached = computed = 0
    per_replica = {e.replica.name: 0 for e in engines}
    reasons: dict[str, int] = {}
    for prompts in rounds:
        routed = []
        for prompt in prompts:
            engine, choice = route(policy, engines, index, prompt)
            reasons[choice.reason] = reasons.get(choice.reason, 0) + 1
            engine.replica.prefill_tokens += len(prompt) - choice.cached_blocks * BLOCK
            routed.append((engine, prompt))
        for engine, prompt in routed:
            hit = engine.prefill(prompt)
            cached += hit
            computed += len(prompt) - hit
            per_replica[engine.replica.name] += len(prompt) - hit
        for e in engines:
            e.replica.prefill_tokens = 0
            e.report(index)
    return cached, computed, per_replica, reasons


def test_conversations_sharing_a_system_prompt_reuse_their_turns_and_spread():
    prompts = [list(p) for p in conversations(turns=4, count=8)]
    # a turn of each chat at a time, in a different order each turn (as they would arrive)
    rounds = [random.Random(t).sample(prompts[t * 8 : t * 8 + 8], 8) for t in range(4)]
    ideal = 0  # every turn finding its whole previous prompt (and the system prompt)
    seen: list[list[int]] = []
    for prompt in prompts:
        longest = max((len(p) for p in seen if prompt[: len(p)] == p), default=96)
        ideal += (min(longest, len(prompt) - 1) // BLOCK) * BLOCK
        seen.append(prompt)
    results = {}
    for policy in PrefillPolicy:
        engines = [Engine("prefill-0"), Engine("prefill-1")]
        results[policy] = serve(policy, engines, rounds)
    cached, computed, per_replica, reasons = results[PrefillPolicy.KV_AWARE]
    assert cached >= 0.85 * ideal
    assert max(per_replica.values()) <= 0.7 * computed
    assert reasons.get("overlap", 0) > 0
    # the others: least-loaded scatters turns, the first-block hash sends all to one replica
    assert results[PrefillPolicy.LEAST_LOADED][0] < cached
    hashed = results[PrefillPolicy.FIRST_BLOCK_HASH]
    assert max(hashed[2].values()) == hashed[1]


def test_a_busy_replicas_cache_is_worth_only_what_it_saves():
    engines = [Engine("prefill-0"), Engine("prefill-1")]
    index = KVIndex()
    prompt = list(range(200))
    engines[0].prefill(prompt)
    engines[0].report(index)
    engine, choice = route(PrefillPolicy.KV_AWARE, engines, index, prompt + [1, 2, 3])
    assert engine is engines[0] and choice.reason == "overlap" and choice.cached_blocks == 12
    engines[0].replica.prefill_tokens = 5000  # far more queued than the prompt costs anywhere
    engine, choice = route(PrefillPolicy.KV_AWARE, engines, index, prompt + [4, 5, 6])
    assert engine is engines[1] and choice.reason == "load"


def test_a_burst_of_one_prefix_is_computed_once_per_replica_before_any_event():
    engines = [Engine("prefill-0"), Engine("prefill-1")]
    index = KVIndex()
    for e in engines:
        e.report(index)
    shared = list(range(500, 820))  # 20 blocks
    computed = 0
    for tail in range(8):  # all routed before any prefill ran or reported
        engine, choice = route(PrefillPolicy.KV_AWARE, engines, index, shared + [tail])
        cost = 321 - choice.cached_blocks * BLOCK
        engine.replica.prefill_tokens += cost
        computed += cost
    assert computed <= 2 * 321 + 6  # the prefix once per replica, then one token each
    # a prediction the engine never confirms is forgotten
    assert index.overlap("prefill-0", block_hashes(shared, BLOCK), now=1e6) == 0


def test_scale_up_and_replacement_move_only_the_prefixes_they_must():
    engines = [Engine("prefill-0"), Engine("prefill-1")]
    index = KVIndex()
    prefixes = [[p] * 64 + list(range(p * 100, p * 100 + 64)) for p in range(1, 9)]
    home = {}
    for i, prefix in enumerate(prefixes):
        engine, _ = route(PrefillPolicy.KV_AWARE, engines, index, prefix + [i])
        engine.prefill(prefix + [i])
        engine.report(index)
        home[i] = engine.replica.name
    assert len(set(home.values())) == 2
    newcomer = Engine("prefill-2")
    newcomer.report(index)
    grown = [*engines, newcomer]
    for i, prefix in enumerate(prefixes):  # each prefix again: it stays where it is cached
        engine, choice = route(PrefillPolicy.KV_AWARE, grown, index, prefix + [99], predict=False)
        assert engine.replica.name == home[i] and choice.reason == "overlap"
    fresh, _ = route(PrefillPolicy.KV_AWARE, grown, index, [7777] * 100)
    assert fresh is newcomer  # new prefixes go where nothing is queued
    # prefill-0 dies: only its prefixes move; the rest stay on prefill-1
    index.drop("prefill-0")
    survivors = [engines[1], newcomer]
    for i, prefix in enumerate(prefixes):
        engine, _ = route(PrefillPolicy.KV_AWARE, survivors, index, prefix + [98], predict=False)
        if home[i] == "prefill-1":
            assert engine is engines[1]


def test_eviction_reaches_the_index_and_a_restarted_engine_is_read_afresh():
    engine = Engine("prefill-0", num_blocks=8)
    index = KVIndex()
    old = list(range(64))  # 4 blocks
    engine.prefill(old + [1])
    engine.report(index)
    assert index.overlap("prefill-0", block_hashes(old, BLOCK), 0.0) == 4
    engine.prefill(list(range(1000, 1127)) + [1])  # 8 blocks: evicts every block of old
    engine.report(index)
    assert index.overlap("prefill-0", block_hashes(old, BLOCK), 0.0) == 0
    replacement = Engine("prefill-0", num_blocks=8)  # same name, a new engine and log
    replacement.prefill(old + [2])
    replacement.report(index)  # the old cursor is another log's: a snapshot
    assert index.blocks("prefill-0") == 4
    assert index.overlap("prefill-0", block_hashes(old, BLOCK), 0.0) == 4


def test_no_event_from_any_replica_yet_is_a_fallback_choice():
    engines = [Engine("prefill-0"), Engine("prefill-1")]
    _, choice = route(PrefillPolicy.KV_AWARE, engines, KVIndex(), list(range(40)), predict=False)
    assert choice.reason == "fallback"


def test_a_prefix_in_a_host_tier_is_indexed_as_offloaded_and_credited_less():
    import torch

    from engine.host_kv_tier import HostKVTier
    from engine.kv_cache import PagedKVCache
    from engine.tiny import TINY_CONFIG
    from router.kv_index import HOST_BLOCK_CREDIT

    cache = PagedKVCache(TINY_CONFIG, 8, BLOCK, torch.float32, torch.device("cpu"))
    engine = Engine("prefill-0", num_blocks=8)
    engine.bm = BlockManager(8, BLOCK, host_tier=HostKVTier(cache, 16))
    index = KVIndex()
    first = [(i * 7) % 250 + 3 for i in range(5 * BLOCK + 1)]  # 5 full blocks
    hashes = block_hashes(first, BLOCK, len(first) - 1)
    engine.prefill(first)
    engine.report(index)
    assert index.overlap("prefill-0", hashes, 0.0) == 5
    engine.prefill([(i * 11) % 250 + 5 for i in range(8 * BLOCK)])  # evicts the first prompt
    engine.report(index)
    assert index.overlap("prefill-0", hashes, 0.0) == 5 * HOST_BLOCK_CREDIT
    assert index.blocks("prefill-0") == 8 + 5  # the device full of the second, the host
    assert engine.prefill(first) == 5 * BLOCK  # served from the host tier
    engine.report(index)
    assert index.overlap("prefill-0", hashes, 0.0) == 5  # back on the device
    # a snapshot (a new reader) knows both tiers as well
    fresh = KVIndex()
    engine.report(fresh)
    assert fresh.overlap("prefill-0", hashes, 0.0) == 5
