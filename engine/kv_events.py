"""What an engine's prefix cache stored and removed, for the router's index of cached blocks
(router/kv_index.py).

The block manager notes each block hash it publishes or drops (``KVEventLog.touched``); a
reader asks for what changed after its cursor (``since``) and gets each hash touched since
then with its state *now* (held or not), so a hash stored and evicted in between reads as
removed, whatever the order. Where the log no longer reaches back to the cursor (it keeps a
bounded number of entries), or the cursor is another log's (a restarted engine), the answer is
a snapshot: every hash held, and the reader replaces what it knew. Nothing is lost to a reader
that polls rarely or misses an answer: the next call with its old cursor gets it again.

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
    call's ``since``). ``snapshot``: ``stored`` is everything the cache holds now."""

    cursor: KVCursor
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    snapshot: bool = False


class KVEventLog:
    """The touched hashes of one prefix cache, the last ``capacity`` of them."""

    def __init__(
        self, held: Callable[[int], bool], everything: Callable[[], Iterable[int]], capacity: int
    ) -> None:
        """``held(hash)``: whether the cache holds it now; ``everything()``: every hash held."""
        self.log_id = uuid.uuid4().hex
        self._held = held
        self._everything = everything
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
            return KVEvents(now, stored=tuple(self._everything()), snapshot=True)
        new = itertools.islice(self._entries, cursor.position - oldest, None)
        stored, removed = [], []
        for block_hash in dict.fromkeys(new):  # each once, in order of first touch
            (stored if self._held(block_hash) else removed).append(block_hash)
        return KVEvents(now, tuple(stored), tuple(removed))
