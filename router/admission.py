"""SLO-aware admission: the router admits only what the cluster can serve within its latency
targets, and refuses the rest at once (429 with Retry-After) instead of letting every
request's latency grow without bound.

Two controls, both fed by what the router itself observes:

- :class:`DecodeSlotLimit`, one per decode (or colocated) replica: how many requests it may
  serve at once while the inter-token time its streams see stays under the TPOT target.
  The limit grows while it binds and TPOT has headroom, and is cut in proportion when TPOT
  passes the target. It adapts to whatever makes a step slow — batch size, context length,
  a prefill sharing the cores — without a model of any of them.
- :class:`TTFTForecast`: a new request's time to first token, forecast as its wait in
  the line for decode capacity (a turn for each request ahead and its own; once the free
  slots are taken, each turn waits for a slot to free) plus the prompt backlog in front of
  it (prompt tokens admitted and still waiting for their first token / the measured speed
  of the pool that computes prompts), corrected by what recent forecasts missed — and by
  what requests still waiting for their first token have already missed. A request whose
  forecast exceeds the TTFT target is refused before it takes any resource.

Everything here is pure bookkeeping on the router's event loop (no I/O, no locks); the
clock is passed in so tests can drive it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.step_cost import StepCost
from router.load_window import percentile


@dataclass(frozen=True)
class SLOTargets:
    """The latency targets admission protects (the cluster config's ``slo``)."""

    ttft_ms: float
    tpot_ms: float
    percentile: float = 90.0  # the SLO holds at this percentile of requests
    scale_with_hardware: bool = True  # floors, not absolutes (cluster.config.SLOConfig)

    def ttft_limit_s(self, own_prefill_s: float) -> float:
        """The TTFT forecast a request may have and be admitted."""
        floor = OWN_WORK_SLACK * own_prefill_s if self.scale_with_hardware else 0.0
        return max(TTFT_HEADROOM * self.ttft_s, floor)

    def tpot_target_s(self, step_alone_s: float | None) -> float:
        """The TPOT a decode replica whose batch-of-one step takes ``step_alone_s`` is held to."""
        floor = TPOT_SLACK * step_alone_s if self.scale_with_hardware and step_alone_s else 0.0
        return max(self.tpot_s, floor)

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"SLO targets must be positive, got {self.ttft_ms}, {self.tpot_ms}")
        if not 0 < self.percentile < 100:
            raise ValueError(f"percentile must be in (0, 100), got {self.percentile}")

    @property
    def ttft_s(self) -> float:
        return self.ttft_ms / 1000.0

    @property
    def tpot_s(self) -> float:
        return self.tpot_ms / 1000.0


# The slot limit keeps the observed mean inter-token time below HEADROOM x the TPOT target,
# not the target itself, so that the slower requests of a window (the SLO is a percentile)
# still meet the target.
HEADROOM = 0.8
# A TTFT forecast is admitted below TTFT_HEADROOM x target: lower than HEADROOM because the
# queue admission fills sits right at that line, and a request's TTFT varies more around
# its forecast (batching, the transfer, CPU contention) than a step time does.
TTFT_HEADROOM = 0.7
# With scale_with_hardware, a request is never refused for a forecast within this many times
# its own prefill: refusal is for overload. On hardware where one prompt alone takes most of
# the TTFT target, any wait would otherwise refuse it, though no schedule could serve it
# sooner.
OWN_WORK_SLACK = 4.0
TPOT_SLACK = 3.0  # likewise, TPOT is not held under this many times a step at a batch of one
GROW_BELOW = 0.6  # grow the limit only while TPOT is under this fraction of the target
MIN_TOKENS = 8  # tokens a window needs before it can move the limit


class DecodeSlotLimit:
    """How many requests one replica may serve at once with TPOT under the target.

    Contract: call :meth:`observe` for every delivery of tokens to a stream after its
    first (``gap_s`` = time since that stream's previous delivery, ``tokens`` = how many
    arrived), and :meth:`update` periodically with the replica's requests in flight. The
    replica takes a new request only while ``in_flight < limit``. The limit starts at
    ``max_limit`` (no limit in practice: admission never refuses on a guess) and is first
    cut when TPOT is seen to pass the target, or when the replica is full (:meth:`full_at`:
    out of KV), so that the router knows a newcomer will wait.

    Each update judges the window of deliveries since the last update that moved the limit
    (or the last ``window_s``): mean inter-token time ``m`` against target ``t``:

    - ``m > HEADROOM·t``: cut to ``in_use · HEADROOM·t / m`` (step time grows at most
      linearly with the batch, so this lands at or under the target), but never below the
      replica's free batch (``update``'s ``floor``: fewer requests than that would not make
      its steps faster, a target its steps miss even alone is not met by refusing); the
      window restarts, so one slow stretch is acted on once. While more than the limit
      are still in flight (a cut has not taken effect: only finishing requests lower it),
      the window restarts without a cut: steps stay slow until the batch has shrunk, and
      cutting again on them would strand the requests waiting for a slot for seconds.
    - ``m < GROW_BELOW·t`` while the limit binds (``in_flight >= limit - 1``): grow by a
      quarter (at least 1), at most ``max_limit``.
    - in between, the replica is near its TPOT budget: the limit holds, and one far above
      what is in flight (the unlimited start) comes down to ``in_flight + 1``, never below
      the free batch (at light load, steps at one or two requests cost what they cost:
      holding a replica to them would only refuse). Load then stops climbing here rather
      than past the target, where the cut would leave requests already waiting for a slot
      stranded behind the excess.
    """

    def __init__(
        self,
        tpot_target_s: float,
        *,
        initial: int | None = None,
        max_limit: int = 1024,
        window_s: float = 2.0,
    ) -> None:
        initial = max_limit if initial is None else initial
        if tpot_target_s <= 0 or initial < 1 or max_limit < 1 or window_s <= 0:
            raise ValueError("DecodeSlotLimit needs a positive target, initial, max and window")
        self.tpot_target_s = tpot_target_s
        self.max_limit = max_limit
        self.limit = min(initial, max_limit)
        self.window_s = window_s
        self._gaps: deque[tuple[float, float, int]] = deque()  # (at, seconds, tokens)
        self.cuts = 0
        self.grows = 0

    def observe(self, now: float, gap_s: float, tokens: int) -> None:
        if tokens > 0 and gap_s >= 0:
            self._gaps.append((now, gap_s, tokens))

    def mean_tpot_s(self, now: float) -> float | None:
        """Mean inter-token time of the current window; None with too few tokens."""
        while self._gaps and self._gaps[0][0] < now - self.window_s:
            self._gaps.popleft()
        tokens = sum(n for _, _, n in self._gaps)
        if tokens < MIN_TOKENS:
            return None
        return sum(gap for _, gap, _ in self._gaps) / tokens

    def full_at(self, in_flight: int) -> None:
        """The replica refused a request for want of KV (or sequence slots) with
        ``in_flight`` requests: it takes no more than that until the limit grows again."""
        self.limit = max(1, min(self.limit, in_flight))

    def update(
        self, now: float, in_flight: int, floor: int = 1, target_s: float | None = None
    ) -> None:
        """``floor``: a limit no TPOT cut goes below — the batch this replica decodes for
        about the price of one (``StepCost.free_batch``), where serving fewer would not make
        its steps faster, only refuse more. ``target_s``: the TPOT to hold it to now
        (``SLOTargets.tpot_target_s``), by default the one it was made with."""
        mean = self.mean_tpot_s(now)
        if mean is None:
            return
        target = self.tpot_target_s if target_s is None else target_s
        if in_flight > self.limit:
            self._gaps.clear()  # the last cut has not taken effect yet: judge it once it has
            return
        if mean > HEADROOM * target:
            in_use = max(1, min(self.limit, in_flight))
            cut = max(1, min(in_use - 1, math.floor(in_use * HEADROOM * target / mean + 1e-9)))
            self._gaps.clear()
            if cut < self.limit and in_use > floor:
                self.limit = max(cut, min(floor, self.limit))
                self.cuts += 1
        elif mean < GROW_BELOW * target:
            if in_flight >= self.limit - 1:
                self.limit = min(self.max_limit, self.limit + max(1, self.limit // 4))
                self.grows += 1
        elif self.limit > max(in_flight + 1, floor):
            self.limit = max(in_flight + 1, floor)


class RateMeter:
    """Events per second over a sliding window. Until the meter has seen a whole window,
    the rate is over the time since its first event (at least a second), so a fresh meter
    does not read a busy start as a slow one."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, float]] = deque()
        self._first: float | None = None

    def add(self, now: float, amount: float = 1.0) -> None:
        if self._first is None:
            self._first = now
        self._events.append((now, amount))

    def rate(self, now: float) -> float:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        if self._first is None:
            return 0.0
        span = min(self.window_s, max(1.0, now - self._first))
        return sum(a for _, a in self._events) / span


class LineTurnTime:
    """How often the line for decode capacity moves: the time between a request's leaving
    it with a reservation and the previous one's (or, if it reached the front of the line
    later, since then). That is the reservation call, plus any wait for a slot or for KV
    to free, divided by the reservations made side by side. A newcomer with ``waiting``
    requests ahead waits about ``(waiting + 1) x`` this.

    The mean over the departures of the last ``window_s`` (at least the latest
    ``min_samples``, however old, once seen), and never less than the current turn (how
    long the line has not moved): a line stuck behind a full pool says so before it moves."""

    def __init__(self, window_s: float = 5.0, min_samples: int = 5) -> None:
        if window_s <= 0 or min_samples < 1:
            raise ValueError("LineTurnTime needs a positive window and sample count")
        self.window_s = window_s
        self.min_samples = min_samples
        self._times: deque[tuple[float, float]] = deque()  # (departed at, turn in seconds)

    def departed(self, now: float, turn_s: float) -> None:
        self._times.append((now, max(0.0, turn_s)))

    def mean_s(self, now: float, current_turn_s: float = 0.0) -> float:
        while len(self._times) > self.min_samples and self._times[0][0] < now - self.window_s:
            self._times.popleft()
        mean = sum(t for _, t in self._times) / len(self._times) if self._times else 0.0
        return max(mean, current_turn_s)


class ReplicaCapacity:
    """What each replica's engine steps cost, as its stats last reported them
    (``engine.step_cost``: measured on its own recent steps). The TTFT forecast reads the
    prompt pool's speed from it; a decode replica's slot limit, its free batch."""

    def __init__(self) -> None:
        self.costs: dict[str, StepCost] = {}

    def update(self, replica: str, cost: StepCost | None) -> None:
        if cost is not None:
            self.costs[replica] = cost

    def forget(self, replica: str) -> None:
        self.costs.pop(replica, None)

    def pool_tokens_per_s(self, replicas: list[str]) -> float | None:
        """Prompt tokens per second of these replicas together; None while none has been
        measured."""
        speeds = [self.costs[r].prefill_tokens_per_s for r in replicas if r in self.costs]
        speeds = [s for s in speeds if s]
        return sum(speeds) if speeds else None

    def step_alone_s(self, replica: str) -> float | None:
        """A decode step at a batch of one on ``replica``; None until measured."""
        cost = self.costs.get(replica)
        return cost.decode_step_s(1) if cost is not None and cost.decode_steps else None

    def free_batch(self, replica: str) -> int:
        """Requests ``replica`` may decode at once for about the price of one (1 unknown)."""
        cost = self.costs.get(replica)
        return cost.free_batch() if cost is not None and cost.decode_steps else 1


@dataclass(frozen=True)
class Forecast:
    slot_wait_s: float
    prefill_s: float
    error_s: float = 0.0  # what the forecast has recently missed by (at the percentile)
    informed: bool = True  # False while a speed it needs is still unmeasured
    own_prefill_s: float = 0.0  # of prefill_s, this prompt's own (0 while unmeasured)

    @property
    def raw_s(self) -> float:
        """The forecast from the queues alone, without the learned error."""
        return self.slot_wait_s + self.prefill_s

    @property
    def ttft_s(self) -> float:
        return max(0.0, self.raw_s + self.error_s)


class TTFTForecast:
    """Forecasts a new request's TTFT from the router's queues and measured speeds.

    ``slot_wait_s``: the wait in the line for decode capacity, ``(waiting + 1)`` turns
    (:class:`LineTurnTime`: how often the line moves). The ``free_slots`` under the
    replicas' slot limits go to the first in line; the k-th turn after them waits for the
    k-th slot to free: when the running requests are expected to end (``slot_ends_s``, from
    router.decode_progress), and past those, at the rate slots freed lately
    (``slots_freed``); with none expected and none freed lately the wait is infinite:
    nothing suggests a slot frees in time.
    ``prefill_s``: the prompt tokens admitted and still waiting for their first token, plus
    this prompt, over the pool's speed. Until that speed is measured (the first half second
    of work), a backlog of up to ``cold_tokens`` forecasts 0 and more is refused: a burst
    at a cold start is taken only as far as a few prefill batches, then as fast as the
    measured speed says.

    ``error_s`` corrects for what the terms leave out — the KV transfer, decode admission,
    token polling, CPU contention: the ``percentile`` of (measured − forecast TTFT) over the
    requests admitted in the last ``window_s``, once there are ``min_samples`` of them. The
    SLO is a percentile, so the forecast is one too: a request is admitted when the
    ``percentile`` of TTFTs like its own would meet the target. A request still waiting for
    its first token past its forecast counts with what it has missed by so far (a lower
    bound on its error): the forecast learns that it is short while the requests it let in
    are still waiting, not a TTFT later. Register each admitted request with
    :meth:`admitted` and end it with :meth:`first_token` or :meth:`forget`.

    While everything is refused no new errors arrive, so an old bad stretch would refuse
    everything: the backend lets a request its queues say is fast through a few times a
    second (a probe), and their errors replace the old ones.
    """

    def __init__(
        self,
        turn_time: LineTurnTime,
        slots_freed: RateMeter,
        capacity: ReplicaCapacity,
        *,
        percentile: float = 90.0,
        window_s: float = 3.0,
        min_samples: int = 10,
        cold_tokens: float = 4096.0,
    ) -> None:
        self.turn_time = turn_time
        self.slots_freed = slots_freed
        self.capacity = capacity
        self.percentile = percentile
        self.window_s = window_s
        self.min_samples = min_samples
        self.cold_tokens = cold_tokens
        self._errors: deque[tuple[float, float]] = deque()  # (at, measured − forecast)
        self._pending: dict[str, tuple[float, float]] = {}  # key → (arrival, raw forecast)

    def admitted(self, key: str, arrival: float, forecast_s: float) -> None:
        """A request arriving at ``arrival`` was admitted on a raw forecast of
        ``forecast_s`` (without the error term); it is pending until its first token."""
        self._pending[key] = (arrival, forecast_s)

    def first_token(self, key: str, now: float) -> float | None:
        """The request's first token reached the router: its error (measured − forecast,
        seconds) is known, and returned."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return None
        arrival, forecast_s = pending
        self.observe(now, forecast_s, now - arrival)
        return now - arrival - forecast_s

    def forget(self, key: str) -> None:
        """The request ended (or was retried) without a first token."""
        self._pending.pop(key, None)

    def observe(self, now: float, forecast_s: float, measured_s: float) -> None:
        """A request's first token came ``measured_s`` after its arrival; it was forecast
        (without the error term) at ``forecast_s``."""
        self._errors.append((now, measured_s - forecast_s))

    def error_s(self, now: float) -> float:
        """The percentile of the errors of the last ``window_s`` together with what pending
        requests have already missed by; once ``min_samples`` errors have been seen, never
        over fewer than the latest ``min_samples`` (however old): an empty window says
        nothing new, and dropping to 0 would admit a burst."""
        while len(self._errors) > self.min_samples and self._errors[0][0] < now - self.window_s:
            self._errors.popleft()
        late = [now - arrival - f for arrival, f in self._pending.values() if now - arrival > f]
        errors = [e for _, e in self._errors] + late
        if len(errors) < self.min_samples:
            return max(late, default=0.0)
        return percentile(errors, self.percentile)

    def forecast(
        self,
        now: float,
        *,
        waiting: int,
        current_turn_s: float,
        free_slots: float,
        prefill_backlog_tokens: int,
        prompt_tokens: int,
        prefill_replicas: list[str],
        slot_ends_s: Sequence[float] = (),
        slots_needed: int = 1,
    ) -> Forecast:
        """``waiting``: requests in the line for decode capacity; ``current_turn_s``: how
        long the line has not moved (0 with no line); ``free_slots``: how many more
        requests the replicas' slot limits let in now; ``slot_ends_s``: when the requests
        holding slots are expected to end, soonest first; ``slots_needed``: the request's
        sequences (OpenAI's n), each a slot."""
        turn = self.turn_time.mean_s(now, current_turn_s)
        turns_for_a_slot = math.ceil(max(0, waiting + slots_needed - free_slots))
        slot_wait = max(0, waiting + 1 - turns_for_a_slot) * turn
        if turns_for_a_slot:
            freed_per_s = self.slots_freed.rate(now)
            per_slot = max(turn, 1.0 / freed_per_s) if freed_per_s > 0 else math.inf
            known = slot_ends_s  # soonest first
            if turns_for_a_slot <= len(known):
                slot_wait += max(known[turns_for_a_slot - 1], turns_for_a_slot * turn)
            elif known:
                slot_wait += known[-1] + (turns_for_a_slot - len(known)) * per_slot
            else:
                slot_wait += turns_for_a_slot * per_slot
        prefill = own = 0.0
        speed = self.capacity.pool_tokens_per_s(prefill_replicas)
        if speed:
            prefill = (prefill_backlog_tokens + prompt_tokens) / speed
            own = prompt_tokens / speed
        elif prefill_backlog_tokens and prefill_backlog_tokens + prompt_tokens > self.cold_tokens:
            prefill = math.inf  # a cold start's burst: no more than ``cold_tokens`` unmeasured
        informed = bool(speed) or not prefill_replicas
        return Forecast(slot_wait, prefill, self.error_s(now), informed, own)
