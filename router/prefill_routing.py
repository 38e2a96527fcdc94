"""Which prefill replica computes a prompt (``router.routing.prefill`` in the config).

- ``kv_aware`` (the default): the replica with the lowest cost, in prompt tokens: the tokens
  of the prompt it would compute (those its prefix cache does not hold, as the router's
  index knows it: router/kv_index.py) plus the prompt tokens this router has sent it that
  are not done yet. Dynamo's KV router scores workers the same way (cached overlap against
  load, in blocks); at equal cost, the one caching fewest blocks, so new prefixes spread over
  the caches. A new or replaced replica starts with nothing cached, so it takes only what
  costs least there: prefixes that other replicas hold stay where they are.
- ``least_loaded``: the fewest prompt tokens in flight, cache ignored.
- ``first_block_hash``: the replica that the hash of the prompt's first block picks among
  those alive, unless its backlog is ``AFFINITY_SLACK_TOKENS`` longer than the shortest
  (the policy before the index; kept to compare against).

Each choice is counted by its reason: ``overlap`` (the cache decided: the chosen replica
holds more of the prompt than another candidate), ``load`` (every candidate holds as much;
the backlog decided), ``fallback`` (the index knows nothing of any candidate yet), ``hash``
(first_block_hash). Used on the router's event loop only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from engine.prefix_hash import chain_hash
from router.kv_index import KVIndex
from router.replicas import Replica

AFFINITY_SLACK_TOKENS = 4096


class PrefillPolicy(str, Enum):
    KV_AWARE = "kv_aware"
    LEAST_LOADED = "least_loaded"
    FIRST_BLOCK_HASH = "first_block_hash"


@dataclass(frozen=True)
class PrefillChoice:
    replica: Replica
    reason: str  # overlap | load | fallback | hash
    # of the prompt's full blocks, those the index says it holds (KVIndex.overlap: a block
    # only in its host tier counts less)
    cached_blocks: float
    computed_tokens: int  # the prompt tokens it would compute, the work it is charged


def choose_prefill(
    policy: PrefillPolicy,
    candidates: Sequence[Replica],
    prompt: Sequence[int],
    hashes: list[int],
    index: KVIndex,
    block_size: int,
    now: float,
) -> PrefillChoice | None:
    """The replica among ``candidates`` (routable prefill replicas) to prefill ``prompt``,
    whose full blocks hash to ``hashes``; None when there is none."""
    if not candidates:
        return None
    ordered = sorted(candidates, key=lambda r: r.name)
    overlaps = {r.name: index.overlap(r.name, hashes, now) for r in ordered}

    def choice(replica: Replica, reason: str) -> PrefillChoice:
        return PrefillChoice(replica, reason, overlaps[replica.name], computed(replica))

    def computed(r: Replica) -> int:
        return max(len(prompt) - int(overlaps[r.name] * block_size), 1)

    if policy is PrefillPolicy.FIRST_BLOCK_HASH:
        preferred = ordered[chain_hash(None, prompt[:block_size]) % len(ordered)]
        least = min(ordered, key=lambda r: r.prefill_tokens)
        if preferred.prefill_tokens - least.prefill_tokens > AFFINITY_SLACK_TOKENS:
            preferred = least
        return choice(preferred, "hash")
    if policy is PrefillPolicy.LEAST_LOADED:
        chosen = min(ordered, key=lambda r: (r.prefill_tokens, r.in_flight))
        return choice(chosen, "load")

    def cost(r: Replica) -> tuple:
        # at equal cost, the replica caching least: new prefixes spread over the caches
        return (computed(r) + r.prefill_tokens, r.in_flight, index.blocks(r.name))

    chosen = min(ordered, key=cost)
    if not any(index.known(r.name) for r in ordered):
        reason = "fallback"
    elif overlaps[chosen.name] > min(overlaps.values()):
        reason = "overlap"
    else:
        reason = "load"
    return choice(chosen, reason)
