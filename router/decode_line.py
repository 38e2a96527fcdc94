"""The line of requests waiting for decode capacity: first come, first served.

Retries and migrations of admitted requests join at the front. Only the front of the line
tries to reserve: up to PARALLEL_RESERVATIONS side by side while reservations succeed, the
head alone once it found no capacity (the line is then "blocked" for a moment). Freed
capacity wakes the front. How often the line moves (``turn_time``) feeds the TTFT forecast.

Used from the router's event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from router.admission import LineTurnTime
from router.timeline import RequestTimeline

T = TypeVar("T")

LINE_BLOCKED_MEMORY_S = 1.0  # the line counts as blocked this long after a head found no room
# While the line is not blocked, this many at its front reserve side by side (each call
# waits for the decode engine's current step, so one at a time caps the line at about one
# reservation per step); once blocked, only the head retries.
PARALLEL_RESERVATIONS = 8
RECHECK_S = 0.05  # KV also frees on the workers' own account: the front re-checks this often


class LineTimeout(Exception):
    """No reservation within the time a request may wait in line."""


@dataclass(eq=False)
class _Place:
    """A request's place in the line."""

    worker_rid: str
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    turn_since: float | None = None  # when it first got to try to reserve


class DecodeLine:
    def __init__(self) -> None:
        self._line: deque[_Place] = deque()
        self._blocked_at = -math.inf  # when its head last found no capacity
        self._moved_at = -math.inf  # when a request last left it with a reservation
        self.turn_time = LineTurnTime()

    @property
    def waiting(self) -> int:
        """Requests in line."""
        return len(self._line)

    @property
    def blocked(self) -> bool:
        """Whether the head found no decode capacity within LINE_BLOCKED_MEMORY_S."""
        return time.monotonic() - self._blocked_at < LINE_BLOCKED_MEMORY_S

    @property
    def waiting_for_capacity(self) -> int:
        """Requests in line while it is blocked (a full decode pool); those merely queued
        behind a reservation call in flight do not count."""
        return self.waiting if self.blocked else 0

    async def reserve(
        self,
        worker_rid: str,
        try_reserve: Callable[[], Awaitable[T | None]],
        timeout_s: float,
        timeline: RequestTimeline,
        front: bool = False,
    ) -> T:
        """Wait in line (at its ``front`` for an admitted request) until ``try_reserve``, called
        on each turn, returns a reservation (None: no capacity now). Raises LineTimeout after
        ``timeout_s``; whatever ``try_reserve`` raises ends the wait too."""
        deadline = time.monotonic() + timeout_s
        place = _Place(worker_rid)
        if front:
            self._line.appendleft(place)
        else:
            self._line.append(place)
        try:
            while True:
                if place in itertools.islice(self._line, self._reserving_now()):
                    if place.turn_since is None:
                        place.turn_since = time.monotonic()
                    place.wake.clear()
                    if timeline.reserve_started is None:
                        timeline.reserve_started = time.monotonic()
                    reserved = await try_reserve()
                    if reserved is not None:
                        timeline.reserved = time.monotonic()
                        self._moved(place)
                        return reserved
                    self._blocked_at = time.monotonic()
                if time.monotonic() > deadline:
                    if place.turn_since is not None:  # its turn counts too
                        self._moved(place)
                    raise LineTimeout
                # Wait for a request to finish somewhere or to reach the front.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(place.wake.wait(), timeout=RECHECK_S)
        finally:
            self._line.remove(place)
            self.wake_front()

    def wake_front(self) -> None:
        """Capacity may have freed: the front tries again now."""
        for place in itertools.islice(self._line, self._reserving_now()):
            place.wake.set()

    def current_turn_s(self) -> float:
        """How long the line has not moved while its front tries (0 with no line)."""
        started = [p.turn_since for p in self._line if p.turn_since is not None]
        if not started:
            return 0.0
        return time.monotonic() - max(self._moved_at, min(started))

    def _reserving_now(self) -> int:
        return 1 if self.blocked else PARALLEL_RESERVATIONS

    def _moved(self, place: _Place) -> None:
        """``place`` leaves after its turn: since the line last moved, or since it got to try
        if that was later."""
        now = time.monotonic()
        self.turn_time.departed(now, now - max(self._moved_at, place.turn_since or now))
        self._moved_at = now
