"""Which KV cache blocks belong to which sequence: allocation, reference counts, prefix cache.

A full block is identified by a hash chain over the token ids of every block up to and
including it, so two sequences with the same prefix share its blocks (reference counted).
Forks of one prompt (``n`` > 1) share all its blocks, the partial last one too; a sequence
about to write into a shared block first gets its own copy (copy-on-write).
Blocks nobody references but that hold a cached prefix stay cached until the allocator needs
them, oldest released first (LRU).

With a host KV tier (engine/host_kv_tier.py) an evicted cached block is first copied there,
and a prefix lookup goes on past the device's hits into the tier: its hits are loaded into
fresh device blocks by ``allocate`` (and published in the device cache again). The tier also
holds preempted sequences' blocks for the scheduler (``swap_out`` / ``swap_in``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import EngineError
from engine.kv_events import KVEventLog
from engine.prefix_hash import chain_hash

if TYPE_CHECKING:  # the router imports this module (kv_cache_misfit) and not torch
    from engine.host_kv_tier import HostKVTier

# The event log keeps this many touches per block of the cache (a reader a few seconds behind
# at full churn still gets changes, not a snapshot), up to a bound for caches of millions
# of blocks (8 bytes an entry; the hashes themselves are the cache's own).
EVENTS_PER_BLOCK = 4
MAX_EVENTS = 1 << 20


def kv_cache_misfit(
    prompt_len: int, max_tokens: int, max_model_len: int, block_size: int, num_blocks: int
) -> str | None:
    """Why a request can never fit a KV cache of ``num_blocks`` blocks, or None if it can:
    it may need up to its prompt plus ``max_tokens`` tokens (at most ``max_model_len``), in
    whole blocks. The engine's check, and the router's before admission."""
    longest = min(prompt_len + max_tokens, max_model_len)
    if -(-longest // block_size) > num_blocks:
        return (
            f"request needs up to {longest} tokens of KV cache but the cache holds "
            f"{num_blocks * block_size}"
        )
    return None


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class HostHit:
    """A prefix block found in the host tier: its slot, name and tokens."""

    slot: int
    block_hash: int
    token_ids: tuple[int, ...]


class BlockManager:
    """Owns the pool of ``num_blocks`` blocks of ``block_size`` tokens.

    Callers: the scheduler (allocate for a sequence, append slots as it grows, free when
    it finishes or is preempted, swap a preempted one out and in) and the KV receiver
    (reserve blocks for an incoming transfer). Not thread-safe: one engine loop owns it.
    ``host_tier``: a host KV tier over this pool's cache; None keeps everything on device.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        host_tier: HostKVTier | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise EngineError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # hold no cached prefix
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, LRU first
        self._cached: dict[int, int] = {}  # chain hash → block id
        self.host_tier = host_tier
        self.prefix_hit_tokens = 0  # tokens served from the prefix cache since start (both tiers)
        self.host_hit_tokens = 0  # of those, loaded from the host tier
        self.prefix_query_tokens = 0  # tokens looked up in it (allocations that used it)
        # What the cache published and dropped, for the router's index (engine/kv_events.py);
        # the tier's blocks count too, hence its share of the log's length.
        touches = EVENTS_PER_BLOCK * (num_blocks + (host_tier.num_slots if host_tier else 0))
        self.events = KVEventLog(
            self._cached.__contains__,
            self._cached.keys,
            min(touches, MAX_EVENTS),
            offloaded=self._offloaded,
            everything_offloaded=self._offloaded_hashes,
        )

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation could take now (free plus evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """The prompt tokens ``allocate`` would serve from the prefix cache now (whole
        blocks, never the one holding the last token); counts nothing."""
        return len(self._prefix_hits(token_ids, len(token_ids))) * self.block_size

    # ---- sequence lifecycle --------------------------------------------------------
    def allocate(
        self, token_ids: Sequence[int], num_tokens: int | None = None, use_cache: bool = True
    ) -> tuple[list[int], int]:
        """Blocks for the first ``num_tokens`` (default all) of ``token_ids``.

        Reuses cached full blocks of the longest matching prefix (unless not ``use_cache``),
        but never the block holding the last token (its logits must be computed): the
        device's, and the host tier's loaded into fresh blocks before this returns (valid
        for any caller) and published in the device cache again. Returns (block table,
        cached token count); raises EngineError if the pool cannot hold it (callers check
        ``can_allocate``).
        """
        num_tokens = len(token_ids) if num_tokens is None else num_tokens
        hits = self._prefix_hits(token_ids, num_tokens) if use_cache else []
        device_hits = [h for h in hits if isinstance(h, int)]
        host_hits = [h for h in hits if isinstance(h, HostHit)]
        needed = self.blocks_needed(num_tokens) - len(device_hits)
        if needed > self._available_excluding(device_hits):
            raise EngineError(f"KV cache full: {needed} blocks needed, {self.num_free_blocks} free")
        for block_id in device_hits:
            self._take(block_id)  # before the fresh blocks: taken, not evicted for them
        fresh = self._take_fresh(needed, [h.slot for h in host_hits])
        loaded = fresh[: len(host_hits)]
        for block_id, hit in zip(loaded, host_hits, strict=True):
            self._publish(self.blocks[block_id], hit.block_hash, hit.token_ids)
        rest = iter(loaded)
        table = [hit if isinstance(hit, int) else next(rest) for hit in hits]
        table += fresh[len(host_hits) :]
        cached_tokens = len(hits) * self.block_size
        self.prefix_hit_tokens += cached_tokens
        self.host_hit_tokens += len(host_hits) * self.block_size
        if use_cache and self.enable_prefix_caching:
            self.prefix_query_tokens += num_tokens
        return table, cached_tokens

    def can_allocate(
        self, token_ids: Sequence[int], num_tokens: int | None = None, use_cache: bool = True
    ) -> bool:
        num_tokens = len(token_ids) if num_tokens is None else num_tokens
        hits = self._prefix_hits(token_ids, num_tokens) if use_cache else []
        # Host hits need fresh device blocks like uncached ones; device hits do not.
        device_hits = [h for h in hits if isinstance(h, int)]
        needed = self.blocks_needed(num_tokens) - len(device_hits)
        return needed <= self._available_excluding(device_hits)

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Append blocks to ``table`` so it holds ``num_tokens``; False (unchanged) if it can't."""
        needed = self.blocks_needed(num_tokens) - len(table)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        table.extend(self._take_fresh(needed))
        return True

    def reserve(self, num_blocks: int) -> list[int]:
        """``num_blocks`` fresh blocks (no prefix lookup), e.g. for an incoming KV transfer.
        Raises EngineError when fewer are free."""
        if num_blocks > self.num_free_blocks:
            raise EngineError(
                f"KV cache full: {num_blocks} blocks needed, {self.num_free_blocks} free"
            )
        return self._take_fresh(num_blocks)

    def fork(self, table: list[int]) -> list[int]:
        """A second table sharing every block of ``table`` (each one's count goes up)."""
        for block_id in table:
            self.blocks[block_id].ref_count += 1
        return list(table)

    def is_shared(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_count > 1

    def copy_on_write(self, table: list[int], index: int) -> tuple[int, int]:
        """Before writing into ``table[index]``, a block another table shares (``is_shared``):
        give this table a fresh block instead and return (source, destination) for the
        caller to copy. Raises EngineError when no block is free."""
        block_id = table[index]
        block = self.blocks[block_id]
        if not self.num_free_blocks:
            raise EngineError("KV cache full: no block free for a copy-on-write")
        fresh = self._allocate_fresh()
        block.ref_count -= 1
        table[index] = fresh
        return block_id, fresh

    def free(self, table: list[int]) -> None:
        """Release a sequence's blocks (last block first, so its tail is evicted first)."""
        for block_id in reversed(table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise EngineError(f"block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)
        table.clear()

    # ---- swapping (host tier) ---------------------------------------------------------
    def can_swap_out(self, num_blocks: int) -> bool:
        """Whether the host tier has room for ``num_blocks`` of a preempted sequence."""
        return self.host_tier is not None and self.host_tier.room() >= num_blocks

    def swap_out(self, block_ids: Sequence[int]) -> list[int]:
        """Copy these blocks (a preempted sequence's computed ones) into pinned host slots;
        the caller then frees its table. Returns the slots, in order. Raises EngineError
        without a tier or room (check ``can_swap_out``)."""
        if self.host_tier is None:
            raise EngineError("swap-out needs a host KV tier")
        slots, dropped = self.host_tier.swap_out(block_ids)
        for block_hash in dropped:
            self.events.touched(block_hash)
        return slots

    def can_swap_in(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free_blocks

    def swap_in(self, slots: Sequence[int], num_tokens: int) -> list[int]:
        """A fresh table for ``num_tokens``, its first blocks loaded from a swapped-out
        sequence's ``slots`` (which leave the tier). Raises EngineError if the pool cannot
        hold it (check ``can_swap_in``)."""
        needed = self.blocks_needed(num_tokens)
        if needed < len(slots):
            raise EngineError(f"{len(slots)} swapped blocks do not fit {num_tokens} tokens")
        if needed > self.num_free_blocks:
            raise EngineError(f"KV cache full: {needed} blocks needed, {self.num_free_blocks} free")
        return self._take_fresh(needed, slots)

    def release_swapped(self, slots: Sequence[int]) -> None:
        """Free the host slots of a swapped-out sequence that will not come back (aborted)."""
        self.host_tier.release(slots)

    def register_full_blocks(
        self, table: list[int], token_ids: Sequence[int], num_computed: int, first: int = 0
    ) -> int:
        """Publish the full blocks among the first ``num_computed`` tokens to the prefix cache,
        from block index ``first`` on (those before it are published already). Returns the
        number of full blocks, the caller's ``first`` next time: each block is hashed once."""
        num_full = num_computed // self.block_size
        if not self.enable_prefix_caching:
            return num_full
        parent = self.blocks[table[first - 1]].hash if first > 0 else None
        for index in range(first, num_full):
            block = self.blocks[table[index]]
            if block.hash is None:
                tokens = self._block_tokens(token_ids, index)
                self._publish(block, chain_hash(parent, tokens), tokens)
            parent = block.hash
        return max(num_full, first)

    # ---- internals ------------------------------------------------------------------
    def _block_tokens(self, token_ids: Sequence[int], index: int) -> tuple[int, ...]:
        return tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])

    def _prefix_hits(self, token_ids: Sequence[int], num_tokens: int) -> list[int | HostHit]:
        """The longest cached prefix, block by block: a device block id where the device
        holds it, else the host tier's entry, until neither does."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int | HostHit] = []
        parent = None
        for index in range((num_tokens - 1) // self.block_size):
            tokens = self._block_tokens(token_ids, index)
            parent = chain_hash(parent, tokens)
            block_id = self._cached.get(parent)
            if block_id is not None and self.blocks[block_id].token_ids == tokens:
                hits.append(block_id)
                continue
            slot = None if self.host_tier is None else self.host_tier.peek(parent, tokens)
            if slot is None:
                break
            hits.append(HostHit(slot, parent, tokens))
        return hits

    def _available_excluding(self, hits: list[int]) -> int:
        # Hit blocks that sit in the evictable list will be taken, not evicted.
        return self.num_free_blocks - sum(1 for b in hits if b in self._evictable)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id, None)
        block.ref_count += 1

    def _publish(self, block: Block, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Name ``block`` and publish it in the device cache (unless another block holds
        that name already)."""
        block.hash = block_hash
        block.token_ids = token_ids
        if block_hash not in self._cached:
            self._cached[block_hash] = block.block_id
            self.events.touched(block_hash)

    def _allocate_fresh(self) -> int:
        return self._take_fresh(1)[0]

    def _take_fresh(self, count: int, loads: Sequence[int] = ()) -> list[int]:
        """``count`` blocks for new contents: free ones first, then the oldest evictable.
        The first ``len(loads)`` get those host slots' contents (prefix hits, or a swapped
        sequence's blocks). An evicted cached block goes to the host tier first, here,
        before it is handed out: callers may write into it at once (the decode side's KV
        lease, from its thread). One that a load lands in takes that load's slot."""
        taken: list[int] = []
        evicted: dict[int, tuple[int, tuple[int, ...]]] = {}  # block → (hash, tokens)
        for _ in range(count):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block = self.blocks[block_id]
                if self._cached.get(block.hash) == block_id:
                    del self._cached[block.hash]
                    evicted[block_id] = (block.hash, block.token_ids)
            taken.append(block_id)
        touched = [block_hash for block_hash, _ in evicted.values()]
        if self.host_tier is not None:
            if loads:
                # Loads first, exchanging with the evicted blocks they land in: a full tier
                # then has nothing to drop for those (the loaded slots take them).
                targets = taken[: len(loads)]
                displaced = [evicted.pop(b, None) for b in targets]
                self.host_tier.move_in(loads, targets, displaced)
            stored = [(b, block_hash, tokens) for b, (block_hash, tokens) in evicted.items()]
            touched += self.host_tier.store(stored)
        elif loads:
            raise EngineError("host slots loaded without a host KV tier")
        # Touched after the copies: the log reads each hash's state when asked (device,
        # host only, or gone), so moved to the host reads as offloaded, not removed.
        for block_hash in touched:
            self.events.touched(block_hash)
        for block_id in taken:
            block = self.blocks[block_id]
            block.hash = None
            block.token_ids = ()
            block.ref_count = 1
        return taken

    def _offloaded(self, block_hash: int) -> bool:
        """Held by the host tier and not on the device (the events' ``offloaded``)."""
        return (
            self.host_tier is not None
            and block_hash not in self._cached
            and self.host_tier.holds(block_hash)
        )

    def _offloaded_hashes(self) -> list[int]:
        if self.host_tier is None:
            return []
        return [h for h in self.host_tier.cached_hashes() if h not in self._cached]
