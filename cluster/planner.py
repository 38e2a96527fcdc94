"""The planner: how many replicas each pool needs. Pure policy (no Ray, no clock of its own).

Every ``interval_s`` the controller (or the simulator) gathers an :class:`Observation` from
the router and the actors and calls :meth:`Planner.decide`; it gets one :class:`Decision`
per pool and starts or drains actors until each pool has ``target`` replicas. The same
object runs under the simulator, with simulated time in ``Observation.time_s``.

How a pool's size is chosen (each step is spelled out in the decision's ``reason``):

- **Prefill (TTFT).** One replica serves ``prefill_tokens_per_s`` prompt tokens/s. A prompt
  of mean length takes ``s = L_in / P`` alone; queued behind others, its tail TTFT is
  modelled as ``s · (1 + k·ρ/(1-ρ))`` (``k`` from the SLO percentile). The largest
  utilisation ρ* meeting the TTFT target sizes the pool: ``need = λ·L_in / (P·ρ*)``.
- **Decode (TPOT).** One replica's step takes ``base + per_seq·b``; the largest batch ``b*``
  meeting the TPOT target (and the KV limit) gives a token rate ``b*/step(b*)``;
  ``need = max(λ·L_out / rate, (running + waiting) / b*)``.
- **Queues before latency.** A prefill backlog older or longer than a fraction of the TTFT
  target, or a prefill queue growing between observations, or requests waiting at the
  router for decode KV, scale up at once: latency percentiles lag a burst by a window.
- **Latency as a check.** An observed percentile above its target adds one replica even
  if the model says enough; observed/expected latency also corrects the per-replica
  capacity (smoothed and bounded), so a wrong start-up measurement heals.
- **Scale-up** is bounded by ``max_step`` per decision and the pool's max. **Scale-down**
  happens only after ``cooldown_s`` since the pool last changed (or since the planner
  started), never while a replica warms up, one ``max_step`` at a time, and only if the
  N−1 replicas left would meet the target with margin at the *highest* load seen over the
  cooldown window — so a load oscillating faster than the cooldown is sized for its peaks
  and does not flap.
- **Warming replicas.** Their samples are already excluded from the observation's
  percentiles by the router; the planner also counts them as capacity and does not react
  to latency or queues of that pool while they warm (their capacity is on its way), and
  does not learn capacity corrections from such windows.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from cluster.config import PlannerConfig, PoolConfig, SLOConfig
from cluster.planner_model import (
    Decision,
    LoadModel,
    Observation,
    PlannerTuning,
    PoolCapacity,
    tail_ttft_s,
)
from workers.pool import Pool

POOLS = (Pool.PREFILL, Pool.DECODE)
COLOCATED = Pool.COLOCATED
HISTORY_LIMIT = 2000  # decisions kept in ``Planner.history``


@dataclass
class _PoolState:
    started_s: float | None = None  # first observation, so start-up counts as a change
    last_change_s: float | None = None
    last_target: int | None = None
    loads: deque = field(default_factory=deque)  # (time_s, arrival_rate, in_len, out_len, busy)
    last_queue: tuple[float, int] | None = None  # (time_s, prefill_queue_tokens)
    growing: int = 0  # consecutive observations with a longer prefill queue
    # size → (time_s, load) at which that many replicas were seen missing the target: the
    # model may be optimistic (heavy-tailed prompts), experience is not. No scale-down back
    # to a size that failed at the load now seen, for ``tuning.memory_s``.
    failed_at: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Need:
    """What one pool's load model says, in words and numbers."""

    replicas: float  # fractional replicas for the load (before ceil)
    reason: str
    latency_bad: str = ""  # non-empty: observed percentile above target
    queue_need: float = 0.0  # replicas needed to drain a backlog (0: no backlog signal)
    queue_reason: str = ""
    # A shortfall of the replicas serving *now* (queue growing, requests waiting for KV):
    # ignored while replicas warm up, whose capacity is about to close it.
    present_need: float = 0.0
    present_reason: str = ""


class Planner(LoadModel):
    """Decides each pool's replica count from an :class:`Observation` (see module doc).

    ``pools`` maps "prefill" and "decode" (or "colocated" with ``colocated=True``) to their
    :class:`PoolConfig` bounds. ``decide`` is deterministic given the sequence of
    observations; it keeps its own history (cooldowns, last changes, capacity corrections).
    """

    def __init__(
        self,
        slo: SLOConfig,
        config: PlannerConfig,
        pools: dict[Pool, PoolConfig],
        capacity: PoolCapacity,
        *,
        colocated: bool = False,
        tuning: PlannerTuning | None = None,
    ) -> None:
        super().__init__(slo, capacity, tuning or PlannerTuning())
        self.config = config
        self.colocated = colocated
        names = (COLOCATED,) if colocated else POOLS
        missing = [n for n in names if n not in pools]
        if missing:
            raise ValueError(f"pools: missing {', '.join(missing)}")
        self.pools = {n: pools[n] for n in names}
        self._state = {n: _PoolState() for n in names}
        self._history: deque[Decision] = deque(maxlen=HISTORY_LIMIT)

    @property
    def history(self) -> list[Decision]:
        return list(self._history)

    # ---- the decision ---------------------------------------------------------------------
    def decide(self, obs: Observation) -> list[Decision]:
        """One Decision per pool. Side effects: updates history, cooldown clocks and
        capacity corrections. Call once per interval with monotonically increasing time."""
        counts, warming = self._counts(obs)
        if not self.colocated:
            # Learn from the window before sizing from it (never from warming windows).
            self._correct_prefill(obs, counts[Pool.PREFILL], warming[Pool.PREFILL])
            self._correct_decode(obs, counts[Pool.DECODE], warming[Pool.DECODE])
        decisions = []
        for pool in self.pools:
            state = self._state[pool]
            if state.started_s is None:
                state.started_s = obs.time_s
            state.loads.append(
                (
                    obs.time_s,
                    obs.arrival_rate,
                    obs.mean_input_len,
                    obs.mean_output_len,
                    obs.decode_running + obs.decode_waiting,
                )
            )
            horizon = max(self.config.cooldown_s, self.config.interval_s)
            while state.loads and state.loads[0][0] < obs.time_s - horizon:
                state.loads.popleft()
            decision = self._decide_pool(pool, obs, counts[pool], warming[pool])
            last = state.last_queue
            grew = last is not None and obs.prefill_queue_tokens > last[1]
            state.growing = state.growing + 1 if grew else 0
            state.last_queue = (obs.time_s, obs.prefill_queue_tokens)
            if decision.target != decision.current:
                state.last_change_s = obs.time_s
            state.last_target = decision.target
            decisions.append(decision)
            self._history.append(decision)
        return decisions

    def _counts(self, obs: Observation) -> tuple[dict[str, int], dict[str, int]]:
        counts = dict.fromkeys(self.pools, 0)
        warming = dict.fromkeys(self.pools, 0)
        for r in obs.replicas:
            if r.pool in counts and not r.draining:
                counts[r.pool] += 1
                warming[r.pool] += r.warming(self.config.warmup_s)
        return counts, warming

    def _need(self, pool: Pool, obs: Observation, current: int) -> _Need:
        if pool == Pool.PREFILL:
            return self._prefill_need(obs, current)
        if pool == Pool.DECODE:
            return self._decode_need(obs, current)
        p, d = self._prefill_need(obs, current), self._decode_need(obs, current)
        # A colocated replica time-shares both phases: their utilisations add up.
        return _Need(
            replicas=p.replicas + d.replicas,
            reason=f"{p.reason} + {d.reason}",
            latency_bad="; ".join(x for x in (p.latency_bad, d.latency_bad) if x),
            queue_need=max(p.queue_need, d.queue_need),
            queue_reason="; ".join(x for x in (p.queue_reason, d.queue_reason) if x),
            present_need=max(p.present_need, d.present_need),
            present_reason="; ".join(x for x in (p.present_reason, d.present_reason) if x),
        )

    def _prefill_need(self, obs: Observation, current: int) -> _Need:
        rate = self.prefill_rate()
        load = obs.arrival_rate * obs.mean_input_len
        replicas, rho = self.prefill_replicas_for(obs.arrival_rate, obs.mean_input_len)
        ttft = self.slo.ttft_ms
        if rho <= 0:
            replicas = math.inf if load > 0 else 0.0
            reason = (
                f"a {obs.mean_input_len:,.0f}-token prompt alone takes "
                f"{self.prefill_service_s(obs.mean_input_len) * 1e3:,.0f} ms ≥ TTFT target "
                f"{ttft:,.0f} ms"
            )
        else:
            reason = (
                f"need {replicas:.2f} for {obs.arrival_rate:.2f} req/s × "
                f"{obs.mean_input_len:,.0f} tok at {rate:,.0f} tok/s/replica (ρ target {rho:.2f}"
                + (
                    f", TTFT model x{self.correction[Pool.PREFILL]:.2f})"
                    if self.correction[Pool.PREFILL] != 1
                    else ")"
                )
            )
        latency_bad = ""
        if obs.ttft_ms is not None and obs.ttft_ms > ttft:
            latency_bad = f"TTFT p{self.slo.percentile:g} {obs.ttft_ms:,.0f} ms > {ttft:,.0f} ms"
        queue_need, queue_reason = 0.0, ""
        trigger_s = self.tuning.queue_trigger * ttft / 1000.0
        drain_s = obs.prefill_queue_tokens / (max(current, 1) * rate)
        if obs.prefill_queue_tokens > 0 and max(drain_s, obs.prefill_queue_time_s) > trigger_s:
            # Clear the backlog on top of serving the arrivals, within the time new replicas
            # take to be useful at all (sooner would size for capacity that comes too late).
            horizon = max(ttft / 1000.0, self.config.warmup_s, self.config.interval_s)
            queue_need = (load + obs.prefill_queue_tokens / horizon) / (
                rate * self.tuning.max_utilization
            )
            queue_reason = (
                f"prefill backlog {obs.prefill_queue_tokens:,} tok ({drain_s:.2f} s to drain, "
                f"oldest {obs.prefill_queue_time_s:.2f} s) > {trigger_s:.2f} s: "
                f"{queue_need:.1f} replicas drain it in {horizon:g} s"
            )
        present = (0.0, "")
        state = self._state.get(Pool.PREFILL, self._state.get(COLOCATED))
        last = state.last_queue
        if last is not None and obs.time_s > last[0] and obs.prefill_queue_tokens > last[1]:
            growth = (obs.prefill_queue_tokens - last[1]) / (obs.time_s - last[0])
            # Growing twice running, the replicas are all busy and arrivals outrun them by
            # `growth` tok/s: that much more capacity, before the TTFT percentile shows it.
            grown = current + growth / (rate * self.tuning.max_utilization)
            sustained = state.growing >= 1
            # Noise: a Poisson queue wobbles; 5% of the pool's capacity is a real shortfall.
            material = growth > 0.05 * max(current, 1) * rate and drain_s > 0.5 * trigger_s
            if sustained and material:
                present = (grown, f"prefill queue growing {growth:,.0f} tok/s")
        return _Need(replicas, reason, latency_bad, queue_need, queue_reason, *present)

    def _decode_need(self, obs: Observation, current: int) -> _Need:
        b = self.decode_batch_limit()
        token_rate = obs.arrival_rate * max(obs.mean_output_len - 1.0, 0.0)
        sequences = obs.decode_running + obs.decode_waiting
        tpot = self.slo.tpot_ms
        replicas = self.decode_replicas_for(token_rate, sequences)
        if b < 1:
            reason = f"decode step {self.decode_step_s(1) * 1e3:.1f} ms ≥ TPOT target {tpot:g} ms"
            replicas = replicas if token_rate or sequences else 0.0
        else:
            reason = (
                f"need {replicas:.2f} for {token_rate:,.0f} tok/s and {sequences} seqs "
                f"at ≤{b} seqs/replica (step {self.decode_step_s(b) * 1e3:.1f} ms)"
            )
        latency_bad = ""
        if obs.tpot_ms is not None and obs.tpot_ms > tpot:
            latency_bad = f"TPOT p{self.slo.percentile:g} {obs.tpot_ms:,.1f} ms > {tpot:g} ms"
        present = (0.0, "")
        if obs.decode_waiting > 0 and obs.decode_pending <= obs.decode_running:
            # Requests wait for KV: the pool is full now, whatever the rate says — unless
            # what fills it is mostly reservations waiting for their prefill (a prefill
            # shortage: more decode replicas would only hold more of them).
            present = (
                max(replicas, current + 1.0),
                f"{obs.decode_waiting} requests waiting for decode KV",
            )
        return _Need(replicas, reason, latency_bad, 0.0, "", *present)

    def _decide_pool(self, pool: Pool, obs: Observation, current: int, warming: int) -> Decision:
        bounds = self.pools[pool]
        lo, hi, step = bounds.min, bounds.max, self.config.max_step
        t = obs.time_s

        def done(target: int, why: str, needed: float = 0.0) -> Decision:
            return Decision(t, pool, current, target, f"{pool}: {why}", needed)

        if not self.config.enabled:
            return done(current, "planner disabled (holding)")
        if current < lo:
            return done(min(lo, current + step) if current else lo, f"below min {lo}")
        if current > hi:
            return done(max(hi, current - step), f"above max {hi}")
        if lo == hi:
            return done(current, f"fixed size {lo}")
        need = self._need(pool, obs, current)
        needed = need.replicas
        desired = math.ceil(needed - 1e-9) if math.isfinite(needed) else hi
        why = [need.reason]
        if need.queue_need > needed:
            # A backlog is measured now, not sampled from warming replicas; the queue need
            # counts the warming ones as capacity, so they are not asked for twice.
            desired = max(desired, math.ceil(need.queue_need - 1e-9))
            why.append(need.queue_reason)
        if warming:
            # Their capacity is on its way and their latency is not representative.
            why.append(f"{warming} warming (latency and queue growth ignored)")
        elif need.present_need > max(needed, need.queue_need):
            desired = max(desired, math.ceil(need.present_need - 1e-9))
            why.append(need.present_reason)
        if not warming and need.latency_bad:
            desired = max(desired, current + 1)
            why.append(need.latency_bad)
        if not warming and (need.latency_bad or need.present_reason or need.queue_reason):
            state = self._state[pool]
            load = self._load(pool, obs.arrival_rate, obs.mean_input_len, obs.mean_output_len)
            seen = state.failed_at.get(current)
            if seen is None or load < seen[1] or t - seen[0] > self.tuning.memory_s:
                state.failed_at[current] = (t, load)

        if desired > current:
            target = min(desired, current + step, hi)
            if target == current:
                return done(current, "; ".join(why) + f" → at max {hi}", needed)
            cap = f" (max_step {step})" if desired > current + step else ""
            cap += f" (max {hi})" if desired > hi else ""
            return done(target, "; ".join(why) + f" → +{target - current}{cap}", needed)

        # Down, or hold: only after the cooldown, never while warming, never past min.
        if desired >= current or current <= lo:
            return done(current, "; ".join(why) + " → hold", needed)
        if warming or need.queue_reason or need.present_reason or need.latency_bad:
            return done(current, "; ".join(why) + " → hold (not while warming/queued/slow)", needed)
        state = self._state[pool]
        since = t - (state.last_change_s if state.last_change_s is not None else state.started_s)
        if since < self.config.cooldown_s:
            return done(
                current,
                "; ".join(why) + f" → hold (cooldown: {since:.0f}/{self.config.cooldown_s:.0f} s)",
                needed,
            )
        target = current
        while target > max(lo, current - step, desired) and self._fits(pool, target - 1):
            target -= 1
        if target == current:
            failed = state.failed_at.get(current - 1)
            if failed and t - failed[0] <= self.tuning.memory_s:
                because = (
                    f"{current - 1} missed the target at {failed[1]:,.0f} tok/s at "
                    f"t={failed[0]:.0f} s, and the last {self.config.cooldown_s:.0f} s came close"
                )
            else:
                because = (
                    f"{current - 1} would not meet the target with margin at the peak load of "
                    f"the last {self.config.cooldown_s:.0f} s"
                )
            return done(current, "; ".join(why) + f" → hold ({because})", needed)
        return done(
            target,
            "; ".join(why)
            + f" → -{current - target} ({target} would still meet the target with margin "
            f"at the peak load of the last {self.config.cooldown_s:.0f} s)",
            needed,
        )

    def _fits(self, pool: Pool, replicas: int) -> bool:
        """Would ``replicas`` meet the target with margin at the peak load of the window?"""
        if replicas < 1:
            return all(rate == 0 and busy == 0 for _, rate, _, _, busy in self._state[pool].loads)
        margin = self.tuning.scale_down_margin
        state = self._state[pool]
        failed = state.failed_at.get(replicas)
        for t, rate, in_len, out_len, busy in state.loads:
            if failed and t - failed[0] <= self.tuning.memory_s:
                if self._load(pool, rate, in_len, out_len) >= margin * failed[1]:
                    return False  # this size already missed the target at such a load
            prefill = decode = 0.0
            if pool.computes_prompts:
                prefill = self.prefill_replicas_for(rate, in_len)[0]
            if pool.decodes:
                decode = self.decode_replicas_for(rate * max(out_len - 1.0, 0.0), busy)
            if prefill + decode > margin * replicas:
                return False
        return True

    @staticmethod
    def _load(pool: Pool, rate: float, in_len: float, out_len: float) -> float:
        """Tokens/s the pool works on (for remembering where a size failed)."""
        if pool == Pool.PREFILL:
            return rate * in_len
        return rate * (out_len if pool == Pool.DECODE else in_len + out_len)

    # ---- capacity correction --------------------------------------------------------------
    def _blend(self, kind: str, ratio: float) -> None:
        lo, hi = self.tuning.correction_bounds
        a = self.tuning.correction_alpha
        value = (1 - a) * self.correction[kind] + a * min(max(ratio, lo), hi)
        self.correction[kind] = min(max(value, lo), hi)

    def _correct_prefill(self, obs: Observation, current: int, warming: int) -> None:
        if warming or current < 1 or obs.ttft_ms is None:
            return
        if obs.arrival_rate < self.tuning.min_rate_for_correction:
            return
        raw = self.capacity.prefill_tokens_per_s
        rho = obs.arrival_rate * obs.mean_input_len / (current * raw)
        trigger_s = self.tuning.queue_trigger * self.slo.ttft_ms / 1000.0
        # Only at moderate load is TTFT mostly service time; the queueing model's error
        # (batching, routing) would otherwise be learnt as a capacity error. A backlog is
        # transient, not a capacity error: the queue signal handles it.
        if rho >= 0.5 or obs.prefill_queue_time_s > trigger_s:
            return
        s = max(obs.mean_input_len, 1.0) / raw
        expected_ms = 1e3 * tail_ttft_s(s, rho, current, self._k)
        self._blend(Pool.PREFILL, obs.ttft_ms / expected_ms)

    def _correct_decode(self, obs: Observation, current: int, warming: int) -> None:
        if warming or current < 1 or obs.tpot_ms is None or obs.decode_running < 1:
            return
        if obs.arrival_rate < self.tuning.min_rate_for_correction or obs.decode_waiting:
            return
        expected_ms = 1e3 * self.capacity.decode_step_s(obs.decode_running / current)
        self._blend(Pool.DECODE, obs.tpot_ms / expected_ms)
