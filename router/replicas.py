"""The worker actors as the router sees them: who is alive, draining, how loaded, and the
routing policies that choose among them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

# A prefill replica keeps a prompt's prefix affinity unless its queue is this many tokens
# longer than the shortest one.
AFFINITY_SLACK_TOKENS = 4096


@dataclass
class Replica:
    name: str
    pool: str  # prefill | decode | colocated
    handle: Any
    stats: dict = field(default_factory=dict)
    alive: bool = True
    draining: bool = False  # takes no new requests; finishes what it has
    in_flight: int = 0  # requests this router sent there that have not finished
    ready_at: float = field(default_factory=time.monotonic)

    @property
    def routable(self) -> bool:
        return self.alive and not self.draining


class ReplicaSet:
    """Replicas of every pool, keyed by actor name. Mutated only on the router's event loop."""

    def __init__(self) -> None:
        self.by_name: dict[str, Replica] = {}

    def add(self, name: str, pool: str, handle: Any) -> Replica:
        replica = Replica(name, pool, handle)
        self.by_name[name] = replica
        return replica

    def remove(self, name: str) -> Replica | None:
        return self.by_name.pop(name, None)

    def pool(self, pool: str) -> list[Replica]:
        return [r for r in self.by_name.values() if r.pool == pool]

    def decode_candidates(self, pool: str, exclude: set[str]) -> list[Replica]:
        """Routable decode (or colocated) replicas, most free KV first, then fewest running."""
        alive = [r for r in self.pool(pool) if r.routable and r.name not in exclude]

        def load(r: Replica) -> tuple:
            free = r.stats.get("free_blocks", 0) - r.in_flight  # in-flight ones will take blocks
            return (-free, r.stats.get("running", 0) + r.in_flight, r.name)

        return sorted(alive, key=load)

    def prefill_choice(
        self, prompt: list[int], block_size: int, exclude: set[str]
    ) -> Replica | None:
        """Prefix affinity (the same first block → the same replica, where it is cached),
        unless that replica's queue is much longer than the shortest."""
        alive = sorted(
            (r for r in self.pool("prefill") if r.routable and r.name not in exclude),
            key=lambda r: r.name,
        )
        if not alive:
            return None
        queued = {
            r.name: r.stats.get("queued_tokens", 0) + r.in_flight * len(prompt) for r in alive
        }
        preferred = alive[hash(tuple(prompt[:block_size])) % len(alive)]
        least = min(alive, key=lambda r: queued[r.name])
        if queued[preferred.name] - queued[least.name] <= AFFINITY_SLACK_TOKENS:
            return preferred
        return least

    def summary(self) -> dict[str, dict]:
        return {
            r.name: {
                **r.stats,
                "pool": r.pool,
                "alive": r.alive,
                "draining": r.draining,
                "in_flight": r.in_flight,
            }
            for r in self.by_name.values()
        }
