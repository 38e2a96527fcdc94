"""The worker actors as the router sees them: who is alive, draining, how loaded, and the
decode routing policy (prefill routing: router/prefill_routing.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.messages import WorkerStats
from workers.pool import Pool


@dataclass
class Replica:
    name: str
    pool: Pool
    handle: Any
    stats: WorkerStats = field(default_factory=WorkerStats)  # its last report
    stats_at: float = 0.0  # when it came (time.time())
    alive: bool = True
    draining: bool = False  # takes no new requests; finishes what it has
    in_flight: int = 0  # requests this router sent there that have not finished
    prefill_tokens: int = 0  # prompt tokens it is computing for this router (prefill calls out)
    ready_at: float = field(default_factory=time.monotonic)

    @property
    def routable(self) -> bool:
        return self.alive and not self.draining


class ReplicaSet:
    """Replicas of every pool, keyed by actor name. Mutated only on the router's event loop."""

    def __init__(self) -> None:
        self.by_name: dict[str, Replica] = {}

    def add(self, name: str, pool: Pool, handle: Any) -> Replica:
        replica = Replica(name, pool, handle)
        self.by_name[name] = replica
        return replica

    def remove(self, name: str) -> Replica | None:
        return self.by_name.pop(name, None)

    def pool(self, pool: Pool) -> list[Replica]:
        return [r for r in self.by_name.values() if r.pool == pool]

    def decode_candidates(
        self, pool: Pool, exclude: set[str], reused: Callable[[Replica], int] | None = None
    ) -> list[Replica]:
        """Routable decode (or colocated) replicas, most free KV first, then fewest running.
        ``reused(replica)``: the prompt's blocks its own prefix cache holds, which it need not
        lease afresh: they count as free there (the KV left free after taking the request)."""
        alive = [r for r in self.pool(pool) if r.routable and r.name not in exclude]

        def load(r: Replica) -> tuple:
            free = r.stats.load.free_blocks - r.in_flight  # in-flight ones will take blocks
            if reused is not None:
                free += reused(r)
            return (-free, r.stats.load.running + r.in_flight, r.name)

        return sorted(alive, key=load)

    def prefill_candidates(self, exclude: set[str] = frozenset()) -> list[Replica]:
        """Routable prefill replicas (router/prefill_routing.py chooses among them)."""
        return [r for r in self.pool(Pool.PREFILL) if r.routable and r.name not in exclude]

    def summary(self) -> dict[str, ReplicaView]:
        return {
            r.name: ReplicaView(r.name, r.pool, r.alive, r.draining, r.in_flight, r.stats)
            for r in self.by_name.values()
        }


@dataclass(frozen=True)
class ReplicaView:
    """A replica as the router last saw it (what the controller plans and reports from)."""

    name: str
    pool: Pool
    alive: bool
    draining: bool
    in_flight: int  # requests this router sent there that have not finished
    stats: WorkerStats
