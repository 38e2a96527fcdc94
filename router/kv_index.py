"""Which prefix-cache blocks each replica holds, cluster-wide: the router's index, built from
the replicas' KV events (engine/kv_events.py) and from its own routing.

A replica's entry is what its engine said it holds (``apply``: its events since the cursor of
the last answer, or a snapshot) plus what the router just sent there (``predict``: a routed
prompt's blocks, counted as held from the moment of routing, so that a burst of one prefix
follows the first request instead of spreading while that one computes). A predicted block
becomes held when the engine reports it stored, and is forgotten after ``predicted_ttl_s``
otherwise (the prefill failed or was cancelled). ``drop`` forgets a replica (dead, drained).

Block hashes are engine/prefix_hash.py's, the engine's own. Used on the router's event loop
only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_events import KVCursor, KVEvents

# Longer than a routed prompt waits in a busy prefill queue and computes.
PREDICTED_TTL_S = 30.0
# What a block only in a replica's host KV tier counts for against one on its device: a hit
# there is a host → device copy instead of a compute, but it is not free and, unlike a
# device hit, takes a fresh device block.
HOST_BLOCK_CREDIT = 0.5


@dataclass
class ReplicaBlocks:
    held: set[int] = field(default_factory=set)  # on its device, as its engine last said
    offloaded: set[int] = field(default_factory=set)  # only in its host KV tier
    predicted: dict[int, float] = field(default_factory=dict)  # routed here → expiry
    cursor: KVCursor | None = None  # where its event log was read up to


class KVIndex:
    def __init__(self, predicted_ttl_s: float = PREDICTED_TTL_S) -> None:
        self.predicted_ttl_s = predicted_ttl_s
        self._replicas: dict[str, ReplicaBlocks] = {}

    def cursor(self, replica: str) -> KVCursor | None:
        """What to ask ``replica``'s ``kv_events`` for next (None: a snapshot)."""
        entry = self._replicas.get(replica)
        return None if entry is None else entry.cursor

    def apply(self, replica: str, events: KVEvents) -> None:
        """``replica``'s answer to ``kv_events(cursor(replica))``."""
        entry = self._replicas.setdefault(replica, ReplicaBlocks())
        if events.snapshot:
            entry.held, entry.offloaded = set(events.stored), set(events.offloaded)
        else:
            entry.held.update(events.stored)
            entry.held.difference_update(events.removed, events.offloaded)
            entry.offloaded.update(events.offloaded)
            entry.offloaded.difference_update(events.removed, events.stored)
        for block_hash in events.stored:
            entry.predicted.pop(block_hash, None)
        entry.cursor = events.cursor

    def predict(self, replica: str, hashes: list[int], now: float) -> None:
        """A prompt with these block hashes was just routed to ``replica``."""
        entry = self._replicas.setdefault(replica, ReplicaBlocks())
        expiry = now + self.predicted_ttl_s
        for block_hash in hashes:
            if block_hash not in entry.held:
                entry.predicted[block_hash] = expiry

    def drop(self, replica: str) -> None:
        self._replicas.pop(replica, None)

    def overlap(self, replica: str, hashes: list[int], now: float) -> float:
        """How many of ``hashes`` (a prompt's blocks, in order) ``replica`` holds as a
        prefix: the blocks its prefix cache would serve, the rest computed. A block only in
        its host tier counts ``HOST_BLOCK_CREDIT``."""
        entry = self._replicas.get(replica)
        if entry is None:
            return 0
        count = 0.0
        for block_hash in hashes:
            if block_hash in entry.held:
                count += 1
                continue
            expiry = entry.predicted.get(block_hash)
            if expiry is not None and expiry > now:
                count += 1
                continue
            if expiry is not None:
                del entry.predicted[block_hash]
            if block_hash not in entry.offloaded:
                break
            count += HOST_BLOCK_CREDIT
        return count

    def blocks(self, replica: str) -> int:
        """Blocks ``replica`` holds, as its engine said (either tier), and was just sent
        (predicted)."""
        entry = self._replicas.get(replica)
        if entry is None:
            return 0
        return len(entry.held) + len(entry.offloaded) + len(entry.predicted)

    def known(self, replica: str) -> bool:
        return replica in self._replicas
