"""Which KV cache blocks belong to which sequence: allocation, reference counts, prefix cache.

A full block is identified by a hash chain over the token ids of every block up to and
including it, so two sequences with the same prefix share its blocks (reference counted).
Forks of one prompt (``n`` > 1) share all its blocks, the partial last one too; a sequence
about to write into a shared block first gets its own copy (copy-on-write).
Blocks nobody references but that hold a cached prefix stay cached until the allocator needs
them, oldest released first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from engine.errors import EngineError
from engine.kv_events import KVEventLog
from engine.prefix_hash import chain_hash

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


class BlockManager:
    """Owns the pool of ``num_blocks`` blocks of ``block_size`` tokens.

    Callers: the scheduler (allocate for a sequence, append slots as it grows, free when
    it finishes or is preempted) and the KV receiver (reserve blocks for an incoming
    transfer). Not thread-safe: one engine loop owns it.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
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
        self.prefix_hit_tokens = 0  # tokens served from the prefix cache since start
        self.prefix_query_tokens = 0  # tokens looked up in it (allocations that used it)
        # What the cache published and dropped, for the router's index (engine/kv_events.py)
        self.events = KVEventLog(
            self._cached.__contains__,
            self._cached.keys,
            min(EVENTS_PER_BLOCK * num_blocks, MAX_EVENTS),
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
        but never the block holding the last token (its logits must be computed). Returns
        (block table, cached token count); raises EngineError if the pool cannot hold it
        (callers check ``can_allocate``).
        """
        num_tokens = len(token_ids) if num_tokens is None else num_tokens
        hits = self._prefix_hits(token_ids, num_tokens) if use_cache else []
        needed = self.blocks_needed(num_tokens) - len(hits)
        if needed > self._available_excluding(hits):
            raise EngineError(f"KV cache full: {needed} blocks needed, {self.num_free_blocks} free")
        table = []
        for block_id in hits:
            self._take(block_id)
            table.append(block_id)
        table.extend(self._allocate_fresh() for _ in range(needed))
        cached_tokens = len(hits) * self.block_size
        self.prefix_hit_tokens += cached_tokens
        if use_cache and self.enable_prefix_caching:
            self.prefix_query_tokens += num_tokens
        return table, cached_tokens

    def can_allocate(
        self, token_ids: Sequence[int], num_tokens: int | None = None, use_cache: bool = True
    ) -> bool:
        num_tokens = len(token_ids) if num_tokens is None else num_tokens
        hits = self._prefix_hits(token_ids, num_tokens) if use_cache else []
        return self.blocks_needed(num_tokens) - len(hits) <= self._available_excluding(hits)

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Append blocks to ``table`` so it holds ``num_tokens``; False (unchanged) if it can't."""
        needed = self.blocks_needed(num_tokens) - len(table)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            return False
        table.extend(self._allocate_fresh() for _ in range(needed))
        return True

    def reserve(self, num_blocks: int) -> list[int]:
        """``num_blocks`` fresh blocks (no prefix lookup), e.g. for an incoming KV transfer.
        Raises EngineError when fewer are free."""
        if num_blocks > self.num_free_blocks:
            raise EngineError(
                f"KV cache full: {num_blocks} blocks needed, {self.num_free_blocks} free"
            )
        return [self._allocate_fresh() for _ in range(num_blocks)]

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
                block.hash = chain_hash(parent, tokens)
                block.token_ids = tokens
                if block.hash not in self._cached:
                    self._cached[block.hash] = block.block_id
                    self.events.touched(block.hash)
            parent = block.hash
        return max(num_full, first)

    # ---- internals ------------------------------------------------------------------
    def _block_tokens(self, token_ids: Sequence[int], index: int) -> tuple[int, ...]:
        return tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])

    def _prefix_hits(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        hits = []
        parent = None
        for index in range((num_tokens - 1) // self.block_size):
            tokens = self._block_tokens(token_ids, index)
            parent = chain_hash(parent, tokens)
            block_id = self._cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def _available_excluding(self, hits: list[int]) -> int:
        # Hit blocks that sit in the evictable list will be taken, not evicted.
        return self.num_free_blocks - sum(1 for b in hits if b in self._evictable)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id, None)
        block.ref_count += 1

    def _allocate_fresh(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            evicted = self.blocks[block_id]
            if self._cached.get(evicted.hash) == block_id:
                del self._cached[evicted.hash]
                self.events.touched(evicted.hash)
        block = self.blocks[block_id]
        block.hash = None
        block.token_ids = ()
        block.ref_count = 1
        return block_id
