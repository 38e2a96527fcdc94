"""SLO-aware admission for one router: the slot limit of each decode replica and the TTFT
forecast (router/admission.py's parts) fed by the router's own streams, and the check that
refuses a request with 429 before it takes any resource when it would miss its TTFT target.

Without SLO targets, only the bookkeeping runs (what the forecast would need) and nothing is
refused here. Used from the router's event loop only.
"""

from __future__ import annotations

import math
import time

from router.admission import (
    DecodeSlotLimit,
    RateMeter,
    ReplicaCapacity,
    SLOTargets,
    TTFTForecast,
)
from router.backend import GenerateRequest, Overloaded
from router.decode_line import DecodeLine
from router.decode_progress import DecodeProgress
from router.replicas import Replica

# With nothing admitted for this long, a request its queues say is fast is let in even if
# the learned forecast error says no: the error is learned only from admitted requests, so
# a stale bad stretch would otherwise refuse everything until it aged out of the window.
PROBE_INTERVAL_S = 0.25


class SLOAdmission:
    def __init__(self, slo: SLOTargets | None, line: DecodeLine) -> None:
        """``slo``: the targets to protect; None admits by the static limits alone."""
        self.slo = slo
        self.line = line
        self.slot_limits: dict[str, DecodeSlotLimit] = {}  # decode replica → its limit
        self.slots_freed = RateMeter()
        self.decode_progress = DecodeProgress()  # when each slot's request should end
        self.capacity = ReplicaCapacity()  # each replica's measured step cost
        self.ttft_forecast = TTFTForecast(
            line.turn_time,
            self.slots_freed,
            self.capacity,
            percentile=slo.percentile if slo else 90.0,
        )
        self.prefill_backlog_tokens = 0  # of admitted prompts still without a first token
        self.refusals_total = 0
        self._last_admission = -math.inf

    # ---- replicas ---------------------------------------------------------------------
    def decode_replica_added(self, name: str) -> None:
        if self.slo is not None:
            self.slot_limits[name] = DecodeSlotLimit(self.slo.tpot_s)

    def replica_removed(self, name: str) -> None:
        self.slot_limits.pop(name, None)
        self.capacity.forget(name)

    def update(self, replica: Replica) -> None:
        """A replica's fresh stats: its step cost, and its slot limit's next value."""
        if self.slo is None:
            return
        self.capacity.update(replica.name, replica.stats.load.step_cost)
        limit = self.slot_limits.get(replica.name)
        if limit is not None:
            limit.update(
                time.monotonic(),
                replica.in_flight,
                floor=self.capacity.free_batch(replica.name),
                target_s=self.slo.tpot_target_s(self.capacity.step_alone_s(replica.name)),
            )

    def free_slots(self, replica: Replica) -> float:
        """How many more sequences ``replica`` takes under its slot limit (any number
        without one)."""
        limit = self.slot_limits.get(replica.name)
        return math.inf if limit is None else max(0, limit.limit - replica.in_flight)

    def has_slots(self, replica: Replica, width: int) -> bool:
        """Whether ``replica``'s slot limit lets ``width`` more sequences in (an idle
        replica takes any one request, however wide)."""
        return self.free_slots(replica) >= width or replica.in_flight == 0

    # ---- the check ----------------------------------------------------------------------
    def check(
        self,
        request: GenerateRequest,
        worker_rid: str,
        width: int,
        candidates: list[Replica],
        prefill_replicas: list[str],
        decode_pool: str,
    ) -> None:
        """Raise Overloaded (429) now for a request of ``width`` sequences that would miss
        its TTFT target; otherwise its forecast is remembered under ``worker_rid`` until its
        first token, to learn the forecast's error. ``candidates``: the decode replicas it
        could go to; ``prefill_replicas``: those that would compute its prompt."""
        slo = self.slo
        if slo is None:
            return
        started = time.monotonic()
        forecast = self.ttft_forecast.forecast(
            started,
            waiting=self.line.waiting,
            current_turn_s=self.line.current_turn_s(),
            free_slots=sum(self.free_slots(r) for r in candidates),
            prefill_backlog_tokens=self.prefill_backlog_tokens,
            prompt_tokens=len(request.prompt_token_ids),
            prefill_replicas=prefill_replicas,
            slot_ends_s=self.decode_progress.slot_ends_s({r.name for r in candidates}, started),
            slots_needed=width,
        )
        now = time.monotonic()
        limit_s = slo.ttft_limit_s(forecast.own_prefill_s)
        probe = forecast.raw_s <= limit_s and now - self._last_admission >= PROBE_INTERVAL_S
        # Nothing ahead of it (no prompt still waiting for its first token, no line, a slot
        # free): its forecast is its own prefill, which refusing it would not make shorter.
        idle = (
            self.prefill_backlog_tokens == 0
            and self.line.waiting == 0
            and candidates
            and not math.isinf(forecast.slot_wait_s)
            and any(self.has_slots(r, width) for r in candidates)
        )
        if forecast.ttft_s > limit_s and not probe and not idle:
            self.refusals_total += 1
            if math.isinf(forecast.prefill_s):
                raise Overloaded(
                    f"{self.prefill_backlog_tokens} prompt tokens are waiting for their first "
                    "token and the prefill speed is not measured yet (the cluster is starting)",
                    retry_after_s=1.0,
                )
            # Come back when the excess wait has passed (unknown: soon; never minutes).
            if math.isinf(forecast.slot_wait_s):
                raise Overloaded(
                    f"every {decode_pool} replica is at the load its TPOT target "
                    f"(at least {slo.tpot_ms:.0f} ms) allows and none has freed a slot lately",
                    retry_after_s=1.0,
                )
            excess_s = forecast.ttft_s - limit_s
            raise Overloaded(
                f"forecast time to first token {forecast.ttft_s * 1000:.0f} ms "
                f"(waiting for decode {forecast.slot_wait_s * 1000:.0f} ms, prefill "
                f"{forecast.prefill_s * 1000:.0f} ms, recent forecast error "
                f"{forecast.error_s * 1000:.0f} ms) is past the {limit_s * 1000:.0f} ms "
                f"admission allows under the {slo.ttft_ms:.0f} ms TTFT target",
                retry_after_s=min(10.0, max(1.0, math.ceil(excess_s))),
            )
        self._last_admission = now
        if forecast.informed:  # its error is worth learning from
            self.ttft_forecast.admitted(worker_rid, request.arrival_time, forecast.raw_s)

    # ---- what the streams tell it -------------------------------------------------------
    def slot_taken(self, worker_rid: str, replica: str, max_tokens: int) -> None:
        self.decode_progress.start(worker_rid, replica, max_tokens)

    def delivered(
        self, worker_rid: str, replica: str, now: float, num_tokens: int, gap_s: float | None
    ) -> None:
        """``num_tokens`` reached the router, ``gap_s`` after the sequence's previous ones."""
        self.decode_progress.delivered(worker_rid, now, num_tokens)
        limit = self.slot_limits.get(replica)
        if limit is not None and gap_s is not None:
            limit.observe(now, gap_s, num_tokens)

    def first_token(self, worker_rid: str, now: float) -> float | None:
        """The prompt admitted under ``worker_rid`` got its first token: the forecast's
        error (seconds), if it was remembered."""
        return self.ttft_forecast.first_token(worker_rid, now)

    def sequence_ended(self, worker_rid: str) -> None:
        self.ttft_forecast.forget(worker_rid)
        self.decode_progress.end(worker_rid)

    def slot_freed(self) -> None:
        self.slots_freed.add(time.monotonic())
