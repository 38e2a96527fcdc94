"""A second KV tier in host memory, beside the device's paged cache.

A pool of ``num_host_blocks`` slots, each the size of one device cache block across all
layers: K and V, and the fp8 scales when the cache is fp8. Slots hold two kinds of contents:

- **cached** prefix blocks, by chain hash (engine/prefix_hash.py) with their tokens: what
  the device's prefix cache evicted (the block manager copies a cached block here before it
  reuses it). LRU: when no slot is free, the oldest cached block is dropped.
- **pinned** slots: the blocks of a sequence swapped out on preemption (the scheduler's
  choice). Never dropped; freed when the sequence is swapped back in or aborted.

The tier is exclusive of the device cache: a block loaded back (``move_in``) leaves its slot,
so device and host together hold twice what either holds. Loading into a device block whose
own cached contents are being evicted for it exchanges the two (the evicted block takes the
slot), so a load into a full device never drops another host block for room.

On CUDA the pool is pinned (page-locked) memory and the copies run on a side stream: an
offload's side stream first waits on the current stream (the block's last writes are queued
there) and the offload is synchronised before it returns (the block is handed out next, and
its new owner may write into it at once from another thread: the decode side's KV lease); a
load's side stream also waits on the current stream (the fresh device blocks' previous owner
may still be read by queued kernels), and the current stream then waits on the load's event
(whatever the engine queues next sees the loaded blocks). On CPU the pool is a separate
tensor pool and the copies are plain ``copy_`` calls: the same path, really copied and timed.

The tier measures its own copies: seconds per block, offload and load, a moving average, so
the scheduler can weigh a swap against a recompute (``copy_cost_s``).

Callers: the block manager (``store`` on eviction, ``peek`` / ``move_in`` for prefix hits,
``swap_out`` / ``move_in`` / ``release`` for the scheduler's swaps), on the engine loop's
thread with the engine lock held. Not thread-safe. The tier owns its slots and their
bookkeeping; the device blocks it copies from and into belong to the block manager, which
says which ones and when. Errors: EngineError for a misuse (a slot neither cached nor pinned
loaded, one not pinned released, a swap-out with no room: callers check ``room`` first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.errors import EngineError
from engine.kv_cache import PagedKVCache

# Weight of the newest copy in the moving averages of seconds per block.
COST_SMOOTHING = 0.25


@dataclass(frozen=True)
class HostEntry:
    """A cached prefix block held in the tier: its slot and its tokens (the hit check)."""

    slot: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class HostTierStats:
    num_slots: int
    cached_slots: int  # prefix blocks held by hash
    pinned_slots: int  # swapped-out sequences' blocks
    offloads: int  # blocks copied device → host, ever (evictions and swap-outs)
    loads: int  # blocks copied host → device, ever (prefix hits and swap-ins)
    dropped: int  # cached blocks dropped for room, ever
    offload_s_per_block: float | None  # None until measured
    load_s_per_block: float | None

    @property
    def used_slots(self) -> int:
        return self.cached_slots + self.pinned_slots


class HostKVTier:
    """``num_host_blocks`` host slots for the blocks of ``cache``."""

    def __init__(self, cache: PagedKVCache, num_host_blocks: int) -> None:
        if num_host_blocks <= 0:
            raise EngineError(f"the host KV tier needs at least one block, got {num_host_blocks}")
        self.cache = cache
        self.num_slots = num_host_blocks
        self._cuda = cache.device.type == "cuda"
        # One pool per cache tensor (K, V, then fp8 scales), slot-major: [slots, layers, ...],
        # so a slot's bytes are one contiguous run (one DMA per tensor on CUDA).
        self._pools = [
            torch.empty(
                (num_host_blocks, t.shape[0], *t.shape[2:]),
                dtype=t.dtype,
                pin_memory=self._cuda,
            )
            for t in cache.tensors()
        ]
        self._free: list[int] = list(range(num_host_blocks - 1, -1, -1))  # pop() → slot 0 first
        self._cached: OrderedDict[int, HostEntry] = OrderedDict()  # hash → entry, LRU first
        self._hash_of: dict[int, int] = {}  # cached slot → its hash
        self._pinned: set[int] = set()
        self.offloads = 0
        self.loads = 0
        self.dropped = 0
        self.offload_s_per_block: float | None = None
        self.load_s_per_block: float | None = None
        if self._cuda:
            self._stream = torch.cuda.Stream(cache.device)
            # CUDA load timings: (start, end, blocks), read once the copies are done
            self._pending_loads: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []

    # ---- bookkeeping ------------------------------------------------------------------
    def holds(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def cached_hashes(self) -> Iterable[int]:
        return self._cached.keys()

    def peek(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The slot holding the cached block ``block_hash`` with exactly these tokens, or
        None. Changes nothing (``can_allocate`` asks too)."""
        entry = self._cached.get(block_hash)
        if entry is None or entry.token_ids != token_ids:
            return None
        return entry.slot

    def room(self) -> int:
        """Slots a store or swap-out could take now: free ones, and cached ones it may drop."""
        return len(self._free) + len(self._cached)

    def stats(self) -> HostTierStats:
        self._read_load_timings()
        return HostTierStats(
            num_slots=self.num_slots,
            cached_slots=len(self._cached),
            pinned_slots=len(self._pinned),
            offloads=self.offloads,
            loads=self.loads,
            dropped=self.dropped,
            offload_s_per_block=self.offload_s_per_block,
            load_s_per_block=self.load_s_per_block,
        )

    def copy_cost_s(self, num_blocks: int) -> float | None:
        """What a swap of ``num_blocks`` costs, out and back in, as measured; None before
        any copy was measured. One direction measured stands for the other (the same
        bytes over the same link)."""
        self._read_load_timings()
        offload, load = self.offload_s_per_block, self.load_s_per_block
        if offload is None and load is None:
            return None
        offload = load if offload is None else offload
        load = offload if load is None else load
        return num_blocks * (offload + load)

    # ---- copies -----------------------------------------------------------------------
    def store(self, blocks: Sequence[tuple[int, int, tuple[int, ...]]]) -> list[int]:
        """Copy evicted cached device blocks, each (block id, chain hash, tokens), into
        cached slots before their device blocks are reused. A hash held already is only
        refreshed (same tokens, same K/V). Blocks that find no room (every slot pinned) are
        not kept. Returns the hashes dropped to make room."""
        dropped: list[int] = []
        copies: list[tuple[int, int]] = []
        for block_id, block_hash, token_ids in blocks:
            if block_hash in self._cached:
                self._cached.move_to_end(block_hash)
                continue
            slot = self._take_slot(dropped)
            if slot is None:  # every slot pinned
                continue
            self._cache(slot, block_hash, token_ids)
            copies.append((block_id, slot))
        self._offload(copies)
        return dropped

    def swap_out(self, block_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Copy a preempted sequence's blocks into pinned slots (dropping cached blocks for
        room). Returns (slots in the order of ``block_ids``, hashes dropped). Raises
        EngineError without room (check ``room``)."""
        if len(block_ids) > self.room():
            raise EngineError(
                f"host KV tier full: {len(block_ids)} slots needed, {self.room()} available"
            )
        dropped: list[int] = []
        slots = []
        for _ in block_ids:
            slot = self._take_slot(dropped)
            assert slot is not None  # room() counted it
            self._pinned.add(slot)
            slots.append(slot)
        self._offload(list(zip(block_ids, slots, strict=True)))
        return slots, dropped

    def release(self, slots: Iterable[int]) -> None:
        """Free pinned slots whose sequence will not come back (aborted)."""
        for slot in slots:
            if slot not in self._pinned:
                raise EngineError(f"host slot {slot} released but not pinned")
            self._pinned.remove(slot)
            self._free.append(slot)

    def move_in(
        self,
        slots: Sequence[int],
        block_ids: Sequence[int],
        displaced: Sequence[tuple[int, tuple[int, ...]] | None] | None = None,
    ) -> None:
        """Copy slots (cached prefix hits or a swapped sequence's pinned ones) into device
        blocks, in pairs; the slots leave the tier (their cached hashes with them). Where
        ``displaced[i]`` is (hash, tokens), block i holds an evicted cached block now: its
        contents take slot i under that hash (an exchange) instead of the slot going free.
        On return the blocks are valid for anything the engine queues on the current
        stream next (CUDA) or at once (CPU)."""
        displaced = [None] * len(slots) if displaced is None else list(displaced)
        if not len(slots) == len(block_ids) == len(displaced):
            raise EngineError(f"{len(slots)} host slots loaded into {len(block_ids)} blocks")
        if not slots:
            return
        for slot in slots:  # off the books: cached entries leave, pinned ones unpin
            if slot in self._pinned:
                self._pinned.remove(slot)
            elif slot in self._hash_of:
                del self._cached[self._hash_of.pop(slot)]
            else:
                raise EngineError(f"host slot {slot} loaded but neither cached nor pinned")
        exchanges = []  # (block, slot) whose evicted contents go into the slot
        for slot, block_id, evicted in zip(slots, block_ids, displaced, strict=True):
            if evicted is not None and evicted[0] not in self._cached:
                self._cache(slot, *evicted)
                exchanges.append((block_id, slot))
            else:
                self._free.append(slot)
        self._copy_in(list(zip(slots, block_ids, strict=True)), exchanges)
        self.loads += len(slots)
        self.offloads += len(exchanges)

    # ---- internals ----------------------------------------------------------------------
    def _cache(self, slot: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        self._cached[block_hash] = HostEntry(slot, token_ids)
        self._hash_of[slot] = block_hash

    def _take_slot(self, dropped: list[int]) -> int | None:
        """A free slot, else the oldest cached block's (its hash into ``dropped``), else
        None (every slot pinned)."""
        if self._free:
            return self._free.pop()
        if not self._cached:
            return None
        block_hash, entry = self._cached.popitem(last=False)
        del self._hash_of[entry.slot]
        dropped.append(block_hash)
        self.dropped += 1
        return entry.slot

    def _copy_in(self, loads: list[tuple[int, int]], exchanges: list[tuple[int, int]]) -> None:
        """Copy (slot, device block) pairs in; first, each (device block, slot) of
        ``exchanges`` is set aside on the device, and written to its slot after."""
        tensors = self.cache.tensors()
        if self._cuda:
            self._read_load_timings()
            current = torch.cuda.current_stream(self.cache.device)
            # The blocks' previous owners may still be read (or written) by queued kernels.
            self._stream.wait_stream(current)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._stream):
                aside = [[t[:, b].clone() for t in tensors] for b, _ in exchanges]
                start.record()
                for slot, block_id in loads:
                    for tensor, pool in zip(tensors, self._pools, strict=True):
                        tensor[:, block_id].copy_(pool[slot], non_blocking=True)
                end.record()
                # Later copies on this stream, and only they, touch the pool: ordered.
                for (_, slot), parts in zip(exchanges, aside, strict=True):
                    for part, pool in zip(parts, self._pools, strict=True):
                        pool[slot].copy_(part, non_blocking=True)
            current.wait_event(end)
            self._pending_loads.append((start, end, len(loads)))
            return
        aside = [[t[:, b].clone() for t in tensors] for b, _ in exchanges]
        started = time.perf_counter()
        for slot, block_id in loads:
            for tensor, pool in zip(tensors, self._pools, strict=True):
                tensor[:, block_id].copy_(pool[slot])
        loaded = time.perf_counter()
        for (_, slot), parts in zip(exchanges, aside, strict=True):
            for part, pool in zip(parts, self._pools, strict=True):
                pool[slot].copy_(part)
        self._note_load((loaded - started) / len(loads))
        if exchanges:
            per_block = (time.perf_counter() - loaded) / len(exchanges)
            self.offload_s_per_block = _smoothed(self.offload_s_per_block, per_block)

    def _offload(self, copies: list[tuple[int, int]]) -> None:
        """Copy (device block, slot) pairs; done when this returns."""
        if not copies:
            return
        tensors = self.cache.tensors()
        started = time.perf_counter()
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.cache.device))
            with torch.cuda.stream(self._stream):
                for block_id, slot in copies:
                    for tensor, pool in zip(tensors, self._pools, strict=True):
                        pool[slot].copy_(tensor[:, block_id], non_blocking=True)
            # The caller hands the blocks out next: the copies must have read them.
            self._stream.synchronize()
        else:
            for block_id, slot in copies:
                for tensor, pool in zip(tensors, self._pools, strict=True):
                    pool[slot].copy_(tensor[:, block_id])
        per_block = (time.perf_counter() - started) / len(copies)
        self.offload_s_per_block = _smoothed(self.offload_s_per_block, per_block)
        self.offloads += len(copies)

    def _note_load(self, per_block: float) -> None:
        self.load_s_per_block = _smoothed(self.load_s_per_block, per_block)

    def _read_load_timings(self) -> None:
        """CUDA: fold in the timings of loads whose copies have finished."""
        if not self._cuda:
            return
        pending = []
        for start, end, count in self._pending_loads:
            if end.query():
                self._note_load(start.elapsed_time(end) / 1e3 / count)
            else:
                pending.append((start, end, count))
        self._pending_loads = pending


def _smoothed(average: float | None, sample: float) -> float:
    return sample if average is None else average + COST_SMOOTHING * (sample - average)
