"""Replicas and the router as the simulator models them, and the run's configuration.

A **prefill replica** runs one batch at a time: the queued prompts (FCFS) up to
``max_batched_tokens`` (a longer prompt goes alone, as its chunks would), timed by the cost
model; every prompt of the batch gets its first token at the batch's end.

A **decode replica** runs continuous batching. Rather than one event per step, it keeps a
*virtual clock* ``S``: tokens each running sequence has produced, advancing at
``1 / step_time(batch, context)`` between joins and leaves (constant in between). A
sequence joining at ``S0`` with ``n`` tokens to go leaves when ``S = S0 + n``, so a request
costs two events however long its answer. Context per sequence is counted at its
lifetime's mean (prompt + half the answer).

A **colocated replica** has both; a prefill batch stops its decode clock (vLLM's default
schedule, prefill first): that stall is the interference disaggregation removes.

The **router** reserves a decode seat (KV for prompt + answer, and ``max_num_seqs``)
before sending the prompt to prefill, as ``router.ray_backend`` does; requests that find
no seat wait at the router (``decode_waiting``). It sends prompts to the prefill replica
with the fewest queued tokens and reservations to the decode replica with the most free
seats. Prefix affinity is not modelled (random prompts share no prefix). Past
``route_choices`` replicas it compares that many sampled at random (power of d choices),
which keeps the cost per request constant on a 1,000-GPU cluster.

The **serving path** (``SimConfig.serving``, :mod:`cluster.simulator.serving`): a fixed
delay from a prompt's prefill end to its first token (and to its decode join), served
step times as multiples of the engine's, and, where the pools share a host's CPU cores,
every engine step slowed by processor sharing with the router and the load generator.
The default adds nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from cluster.config import PlannerConfig, PoolConfig, SLOConfig
from cluster.planner_model import PoolCapacity
from cluster.simulator.cost_model import CostModel
from cluster.simulator.serving import NO_OVERHEADS, ServingOverheads
from workers.pool import Pool


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment. Pool sizes are ``initial`` (and bounds for the planner);
    ``planner.enabled`` runs the real :class:`cluster.planner.Planner` every interval."""

    cost: CostModel
    slo: SLOConfig = field(default_factory=SLOConfig)
    mode: str = "disaggregated"
    prefill: PoolConfig = field(default_factory=lambda: PoolConfig(replicas=1))
    decode: PoolConfig = field(default_factory=lambda: PoolConfig(replicas=1))
    colocated: PoolConfig = field(default_factory=lambda: PoolConfig(replicas=1))
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    capacity: PoolCapacity | None = None  # what the planner is told; None: from the cost model
    max_batched_tokens: int = 8192
    max_num_seqs: int = 256
    kv_tokens: int | None = None  # KV per decode replica; None: device memory − weights
    startup_s: float = 60.0  # from the planner's decision to a ready replica (load weights)
    route_choices: int = 8
    seed: int = 0
    serving: ServingOverheads = NO_OVERHEADS  # the served path's costs beyond the engine
    # Tensor parallel degree of each disaggregated pool (None: the cost model's tp), as
    # DistServe chooses each phase's parallelism; colocated replicas use the cost model's.
    prefill_tp: int | None = None
    decode_tp: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        if self.max_batched_tokens < 1 or self.max_num_seqs < 1 or self.startup_s < 0:
            raise ValueError("max_batched_tokens and max_num_seqs must be >= 1, startup_s >= 0")
        for name in ("prefill_tp", "decode_tp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def pools(self) -> dict[Pool, PoolConfig]:
        if self.mode == "colocated":
            return {Pool.COLOCATED: self.colocated}
        return {Pool.PREFILL: self.prefill, Pool.DECODE: self.decode}

    def tp(self, pool: Pool) -> int:
        """Devices per replica of ``pool``."""
        chosen = {Pool.PREFILL: self.prefill_tp, Pool.DECODE: self.decode_tp}.get(pool)
        return chosen or self.cost.tp

    def cost_for(self, pool: Pool) -> CostModel:
        """The cost model of one replica of ``pool`` (its own tp)."""
        tp = self.tp(pool)
        return self.cost if tp == self.cost.tp else replace(self.cost, tp=tp)

    def planner_capacity(self, mean_input: float, mean_output: float) -> PoolCapacity:
        """What the planner is told at start-up: prefill from a prompt-serving replica's cost
        model, decode from a decode (or colocated) replica's, each at its own tp."""
        colocated = self.mode == "colocated"
        first = self.cost_for(Pool.COLOCATED if colocated else Pool.PREFILL)
        seat = self.cost_for(Pool.COLOCATED if colocated else Pool.DECODE)
        limits = (self.max_batched_tokens, self.max_num_seqs)
        prefill = first.pool_capacity(mean_input, mean_output, *limits)
        decode = seat.pool_capacity(mean_input, mean_output, *limits)
        return replace(decode, prefill_tokens_per_s=prefill.prefill_tokens_per_s)

    def transfer_cost(self) -> CostModel:
        """KV moves rank to rank: as many links in parallel as the smaller side has ranks."""
        return replace(self.cost, tp=min(self.tp(Pool.PREFILL), self.tp(Pool.DECODE)))

    @property
    def seats(self) -> int:
        """Sequences one decode (or colocated) replica admits: max_num_seqs, and KV."""
        return self.max_num_seqs


class Replica:
    """One replica of any pool; which parts it uses depends on its pool."""

    __slots__ = (
        "name",
        "pool",
        "created_t",
        "ready_t",
        "ready",
        "draining",
        "removed",
        # prefill side
        "queue",
        "queued_tokens",
        "busy_until",
        "batch",
        "batch_tokens",
        # decode side
        "seats",
        "kv_free",
        "heap",
        "ctx",
        "S",
        "t_last",
        "step_s",
        "base_step_s",
        "version",
        "paused",
    )

    def __init__(self, name: str, pool: Pool, created_t: float, ready_t: float, kv_tokens: int):
        self.name = name
        self.pool = pool
        self.created_t = created_t
        self.ready_t = ready_t
        self.ready = False
        self.draining = False
        self.removed = False
        self.queue: deque[int] = deque()
        self.queued_tokens = 0
        self.busy_until = -1.0  # > now while a prefill batch runs
        self.batch: list[tuple] = []  # (request id, its decode replica) of the running batch
        self.batch_tokens = 0
        self.seats = 0  # decode sequences reserved here (running + on their way)
        self.kv_free = kv_tokens
        self.heap: list[tuple[float, int]] = []  # (virtual finish, request id)
        self.ctx = 0.0  # Σ mean context of running sequences
        self.S = 0.0
        self.t_last = 0.0
        self.step_s = 0.0  # current decode step: base_step_s x the host's CPU slowdown
        self.base_step_s = 0.0  # the served step with the CPU to itself
        self.version = 0
        self.paused = False

    def advance(self, t: float) -> None:
        """Move the decode clock to ``t``."""
        if self.heap and not self.paused and self.step_s > 0:
            self.S += (t - self.t_last) / self.step_s
        self.t_last = t

    @property
    def outstanding_tokens(self) -> int:
        """Prompt tokens queued or in the running batch: what the router balances."""
        return self.queued_tokens + self.batch_tokens

    @property
    def idle(self) -> bool:
        return not self.queue and not self.batch and self.seats == 0

    def age(self, t: float) -> float:
        return t - self.ready_t
