"""KV between tensor-parallel replicas: which KV heads each prefill rank sends to each decode
rank, and whether two pools' layouts can meet at all.

A replica of tp t holds the model's KV heads split over its ranks (engine.tensor_parallel):
rank r's cache holds heads [start, stop) of the model's. A prefill replica of tp a fills a
decode replica of tp b rank to rank, re-sharded on the wire: every decode rank receives
exactly its heads, each from the lowest prefill rank that holds it (with replicated heads,
a > Hkv, the other holders stay silent), so no process ever gathers the whole cache. The
first token travels on the stream from prefill rank 0 to decode rank 0, which always exists
(both hold head 0).

Pure functions and frozen data; thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv_transfer.frames import fingerprint_diff

HeadRange = tuple[int, int]  # [start, stop) of the model's KV heads


@dataclass(frozen=True)
class RankReceiver:
    """One decode rank's receiver, as a KV handle lists it."""

    address: str  # the transport's address of that rank's receiver
    heads: HeadRange


@dataclass(frozen=True)
class Route:
    """One stream of a transfer: KV heads ``heads`` from sender rank ``sender`` to the
    handle's receiver ``receiver``."""

    sender: int
    receiver: int
    heads: HeadRange


def routes(senders: Sequence[HeadRange], receivers: Sequence[HeadRange]) -> list[Route]:
    """The streams that give every receiver rank each of its heads exactly once, from the
    lowest sender rank holding it (contiguous heads of one pair in one stream). Raises
    ValueError when a receiver holds a head no sender has."""
    out: list[Route] = []
    for receiver, (lo, hi) in enumerate(receivers):
        head = lo
        while head < hi:
            sender = next((s for s, (a, b) in enumerate(senders) if a <= head < b), None)
            if sender is None:
                raise ValueError(
                    f"receiver rank {receiver} holds KV head {head}, which no sender rank has "
                    f"(senders hold {list(senders)})"
                )
            stop = min(hi, senders[sender][1])
            out.append(Route(sender, receiver, (head, stop)))
            head = stop
    return out


@dataclass(frozen=True)
class KVLayout:
    """What a replica's KV looks like to a peer: from its ``info()`` (engine.describe)."""

    name: str  # the replica, for messages
    fingerprint: dict
    block_size: int
    kv_cache_dtype: str
    heads_by_rank: tuple[HeadRange, ...]

    @classmethod
    def from_info(cls, info: dict) -> KVLayout:
        tp = info.get("tensor_parallel") or {}
        heads = tp.get("kv_heads") or [[0, int(info["fingerprint"]["num_kv_heads"])]]
        return cls(
            name=str(info.get("name", "?")),
            fingerprint=dict(info["fingerprint"]),
            block_size=int(info["block_size"]),
            kv_cache_dtype=str(info["kv_cache_dtype"]),
            heads_by_rank=tuple((int(a), int(b)) for a, b in heads),
        )

    def describe(self) -> str:
        return (
            f"{self.name} (tp {len(self.heads_by_rank)}, KV heads per rank "
            f"{[list(h) for h in self.heads_by_rank]}, block size {self.block_size}, KV cache "
            f"{self.kv_cache_dtype.removeprefix('torch.')})"
        )


def layout_problem(
    prefill: KVLayout, decode: KVLayout, *, wire_dtype: str, transport: str
) -> str | None:
    """Why ``prefill`` cannot fill ``decode``'s cache, naming both sides; None if it can."""
    reasons = []
    if prefill.fingerprint != decode.fingerprint:
        diff = fingerprint_diff(prefill.fingerprint, decode.fingerprint)
        reasons.append(f"their models differ in {diff}")
    if prefill.block_size != decode.block_size:
        reasons.append("their block sizes differ")
    if "float8" in decode.kv_cache_dtype and wire_dtype != "fp8":
        reasons.append("the decode cache is fp8, which needs kv.wire_dtype 'fp8'")
    tp = max(len(prefill.heads_by_rank), len(decode.heads_by_rank))
    if tp > 1 and transport not in ("grpc", "auto"):
        reasons.append(
            f"kv.transport {transport!r} moves the KV of tp 1 replicas only (sharded "
            "replicas send each rank's heads over 'grpc'; 'auto' picks it for them)"
        )
    if not reasons:
        try:
            routes(prefill.heads_by_rank, decode.heads_by_rank)
        except ValueError as err:
            reasons.append(str(err))
    if not reasons:
        return None
    return f"{prefill.describe()} cannot send KV to {decode.describe()}: " + "; ".join(reasons)
