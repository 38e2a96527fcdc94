"""How far each decoding request is from its end: when the next decode slot frees.

The router streams every token, so it knows each running request's tokens left (at most
max_tokens − tokens so far; EOS can only end it sooner) and its pace (seconds per token so
far). The soonest of those ends is when a replica at its slot limit takes the next request
— known from the work in flight, not guessed from how often slots freed lately (at light
load, one every several seconds, or none in the last window).

Who calls: the router's event loop only (RayBackend's attempts and its admission).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Decoding:
    replica: str
    tokens_left: int
    first_token_at: float | None = None
    last_at: float = 0.0
    tokens: int = 0  # delivered since (and including) the first


class DecodeProgress:
    def __init__(self) -> None:
        self._running: dict[str, _Decoding] = {}  # attempt key → its progress

    def start(self, key: str, replica: str, max_tokens: int) -> None:
        """An attempt holds a slot on ``replica`` and will generate at most ``max_tokens``."""
        self._running[key] = _Decoding(replica, max_tokens)

    def delivered(self, key: str, now: float, num_tokens: int) -> None:
        entry = self._running.get(key)
        if entry is None or num_tokens <= 0:
            return
        if entry.first_token_at is None:
            entry.first_token_at = now
            entry.tokens = num_tokens
        else:
            entry.tokens += num_tokens
        entry.tokens_left = max(0, entry.tokens_left - num_tokens)
        entry.last_at = now

    def end(self, key: str) -> None:
        self._running.pop(key, None)

    def slot_ends_s(self, replicas: set[str], now: float) -> list[float]:
        """Seconds until each of ``replicas``' decoding requests is expected to end (its
        tokens left at its own pace so far), soonest first; those without a pace yet (fewer
        than two tokens) are left out."""
        ends = []
        for entry in self._running.values():
            if entry.replica not in replicas or entry.first_token_at is None or entry.tokens < 2:
                continue
            pace = (entry.last_at - entry.first_token_at) / (entry.tokens - 1)
            ends.append(max(0.0, entry.tokens_left * pace - (now - entry.last_at)))
        return sorted(ends)
