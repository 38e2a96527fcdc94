"""What an engine's prefix cache stored, offloaded and removed, for the router's index of
cached blocks (router/kv_index.py).

A block hash is in one of three states: on the device (in the device prefix cache: a prompt
hitting it computes nothing for it), offloaded (only in the engine's host KV tier,
engine/host_kv_tier.py: a hit costs a host → device copy, no compute), or gone. The block
manager notes each hash whose state may have changed (``KVEventLog.touched``: published,
evicted to the host, loaded back, dropped); a reader asks for what changed after its cursor
(``since``) and gets each hash touched since then once, with its state *now*: in ``stored``
(device), ``offloaded`` (host only) or ``removed`` (neither), so a hash stored and evicted in
between reads as removed (or offloaded), whatever the order. A hash moving device → host is
listed in ``offloaded``, never in ``removed``; host → dropped in ``removed``; host → device (a
hit loaded back) in ``stored``; one held by both reads as ``stored``. An engine without a
host tier never lists anything in ``offloaded``.

Where the log no longer reaches back to the cursor (it keeps a bounded number of entries),
or the cursor is another log's (a restarted engine), the answer is a snapshot: every hash on
the device in ``stored``, every host-only one in ``offloaded``, and the reader replaces what
it knew. Nothing is lost to a reader that polls rarely or misses an answer: the next call
with its old cursor gets it again.

Not thread-safe: one engine loop owns the log (the worker reads it under the loop's lock).
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCursor:
    """Where a reader is in one log: the log's id and the position it has read up to."""

    log_id: str
    position: int


@dataclass(frozen=True)
class KVEvents:
    """What changed in a prefix cache after the reader's cursor, up to ``cursor`` (the next
    call's ``since``): each hash touched since, by its state now. ``snapshot``: ``stored``
    is everything the device holds now and ``offloaded`` everything only the host tier
    holds (an engine without a tier never offloads: ``offloaded`` is always empty)."""

    cursor: KVCursor
    stored: tuple[int, ...] = ()  # on the device now
    removed: tuple[int, ...] = ()  # held nowhere now
    snapshot: bool = False
    offloaded: tuple[int, ...] = ()  # in the host tier only now


class KVEventLog:
    """The touched hashes of one prefix cache, the last ``capacity`` of them."""

    def __init__(
        self,
        held: Callable[[int], bool],
        everything: Callable[[], Iterable[int]],
        capacity: int,
        offloaded: Callable[[int], bool] = lambda block_hash: False,
        everything_offloaded: Callable[[], Iterable[int]] = tuple,
    ) -> None:
        """``held(hash)``: whether the device cache holds it now; ``everything()``: every
        hash held there. ``offloaded(hash)``: whether only the host tier holds it now;
        ``everything_offloaded()``: every such hash."""
        self.log_id = uuid.uuid4().hex
        self._held = held
        self._everything = everything
        self._offloaded = offloaded
        self._everything_offloaded = everything_offloaded
        self._entries: deque[int] = deque(maxlen=capacity)
        self._position = 0  # entries ever written; the newest is at _position - 1

    def touched(self, block_hash: int) -> None:
        self._entries.append(block_hash)
        self._position += 1

    def since(self, cursor: KVCursor | None) -> KVEvents:
        now = KVCursor(self.log_id, self._position)
        oldest = self._position - len(self._entries)
        if (
            cursor is None
            or cursor.log_id != self.log_id
            or not oldest <= cursor.position <= self._position
        ):
            return KVEvents(
                now,
                stored=tuple(self._everything()),
                snapshot=True,
                offloaded=tuple(self._everything_offloaded()),
            )
        new = itertools.islice(self._entries, cursor.position - oldest, None)
        stored, removed, offloaded = [], [], []
        for block_hash in dict.fromkeys(new):  # each once, in order of first touch
            if self._held(block_hash):
                stored.append(block_hash)
            elif self._offloaded(block_hash):
                offloaded.append(block_hash)
            else:
                removed.append(block_hash)
        return KVEvents(now, tuple(stored), tuple(removed), offloaded=tuple(offloaded))
