"""The cluster config: a YAML file (or the embedded default), validated into dataclasses.
Errors name the bad key (``pools.decode.replicas: must be >= 1``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.replica_shape import ReplicaShape
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.named_models import DEFAULT_MODEL
from kv_transfer.options import KVTransferOptions
from router.config import RouterConfig, RouterLimits, RoutingConfig
from workers.options import WorkerOptions
from workers.pool import Pool


class ConfigError(ValueError):
    """The cluster config is invalid; the message names the key."""


@dataclass(frozen=True)
class PoolConfig:
    """One pool's size bounds and per-replica resources. ``replicas`` is shorthand for a
    fixed size (min = max = initial)."""

    replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    initial_replicas: int | None = None
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    # Custom Ray resources a replica reserves beside its CPUs and GPUs, e.g.
    # {"accelerator_type:H100": 0.001} (the node type) or a resource `ray start --resources`
    # gave some nodes.
    resources: dict = field(default_factory=dict)
    # Ray node labels a replica's node must have (`ray start --labels`), e.g. {"pool":
    # "decode"}; values take Ray's selector syntax ("!v", "in(a,b)").
    node_labels: dict = field(default_factory=dict)
    # A replica that cannot be placed for this long is given up (and planned again): it
    # waits for free room or for the autoscaler's new node until then, never blocking the rest.
    placement_timeout_s: float = 600.0
    engine: dict = field(default_factory=dict)  # EngineConfig overrides for this pool

    def __post_init__(self) -> None:
        for name in ("replicas", "min_replicas", "max_replicas", "initial_replicas"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0
            ):
                raise ConfigError(f"{name}: must be an integer >= 0, got {value!r}")
        if self.replicas is not None and self.replicas < 1:
            raise ConfigError(f"replicas: must be an integer >= 1, got {self.replicas!r}")
        if not self.min <= self.initial <= self.max:
            raise ConfigError(
                f"replicas: need min_replicas <= initial_replicas <= max_replicas, got "
                f"{self.min} <= {self.initial} <= {self.max}"
            )
        if self.initial < 1:
            raise ConfigError("initial_replicas: a pool starts with at least one replica")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ConfigError("num_cpus and num_gpus must be >= 0")
        if not isinstance(self.resources, dict) or not all(
            isinstance(k, str) and k and isinstance(v, int | float) and v > 0
            for k, v in self.resources.items()
        ):
            raise ConfigError(
                f"resources: must map resource names to positive amounts, got {self.resources!r}"
            )
        reserved = {"CPU", "GPU"} & set(self.resources)
        if reserved:
            raise ConfigError(
                f"resources: set {', '.join(sorted(reserved))} with num_cpus/num_gpus"
            )
        if not isinstance(self.node_labels, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) and v
            for k, v in self.node_labels.items()
        ):
            raise ConfigError(
                f"node_labels: must map label names to strings, got {self.node_labels!r}"
            )
        if not self.num_cpus and not self.num_gpus and not self.resources:
            raise ConfigError(
                "a replica must reserve something (num_cpus, num_gpus or resources) to be placed"
            )
        if not self.placement_timeout_s > 0:
            raise ConfigError(
                f"placement_timeout_s: must be positive, got {self.placement_timeout_s!r}"
            )

    def shape(self) -> ReplicaShape:
        """What one replica reserves (cluster.placement)."""
        bundle = {"CPU": float(self.num_cpus), "GPU": float(self.num_gpus), **self.resources}
        return ReplicaShape({k: float(v) for k, v in bundle.items() if v}, dict(self.node_labels))

    @property
    def initial(self) -> int:
        if self.initial_replicas is not None:
            return self.initial_replicas
        if self.replicas is not None:
            return self.replicas
        return max(1, self.min_replicas or 1)

    @property
    def min(self) -> int:
        if self.min_replicas is not None:
            return self.min_replicas
        return self.replicas if self.replicas is not None else min(1, self.initial_replicas or 1)

    @property
    def max(self) -> int:
        if self.max_replicas is not None:
            return self.max_replicas
        if self.replicas is not None:
            return self.replicas
        return max(self.initial_replicas or 1, self.min_replicas or 1)


@dataclass(frozen=True)
class SLOConfig:
    """Latency targets: the ``percentile`` of TTFT (prefill pool) and TPOT (decode pool).

    ``scale_with_hardware`` (SLO-aware admission): the targets are floors. Where one request
    alone takes most of them (a real model on a CPU), a request is refused only when its
    forecast passes 4x its own prefill, and a decode replica is held to 3x its own
    batch-of-one step: refusal is for overload, not for hardware no schedule could make
    faster. False: the targets are absolute."""

    ttft_ms: float = 2000.0
    tpot_ms: float = 200.0
    percentile: float = 90.0
    scale_with_hardware: bool = True

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_ms <= 0:
            raise ConfigError("ttft_ms and tpot_ms: must be positive")
        if not 50.0 <= self.percentile < 100.0:
            raise ConfigError(f"percentile: must be in [50, 100), got {self.percentile}")


@dataclass(frozen=True)
class PlannerConfig:
    """How often and how fast the planner may resize the pools."""

    enabled: bool = False
    interval_s: float = 5.0
    cooldown_s: float = 30.0  # no scale-down sooner than this after any change of that pool
    max_step: int = 1  # replicas added or removed per pool per decision
    warmup_s: float = 10.0  # samples from a replica younger than this are ignored

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.cooldown_s < 0 or self.warmup_s < 0:
            raise ConfigError("interval_s must be > 0; cooldown_s and warmup_s >= 0")
        if not isinstance(self.max_step, int) or self.max_step < 1:
            raise ConfigError(f"max_step: must be an integer >= 1, got {self.max_step!r}")


@dataclass(frozen=True)
class ClusterConfig:
    model: str = DEFAULT_MODEL
    mode: str = "disaggregated"  # or colocated
    engine: dict = field(default_factory=dict)  # EngineConfig fields shared by every pool
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    colocated: PoolConfig = field(default_factory=PoolConfig)
    kv: KVTransferOptions = field(default_factory=KVTransferOptions)
    router: RouterConfig = field(default_factory=RouterConfig)
    limits: RouterLimits = field(default_factory=RouterLimits)  # YAML: router.limits
    routing: RoutingConfig = field(default_factory=RoutingConfig)  # YAML: router.routing
    slo: SLOConfig = field(default_factory=SLOConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    torch_threads: int | None = 1  # per worker on CPU: two workers on two cores must not fight
    namespace: str = "pdcluster"

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ConfigError(f"mode: must be 'disaggregated' or 'colocated', got {self.mode!r}")
        for pool in Pool:
            try:
                self.engine_config(pool)
            except (EngineError, TypeError) as err:
                raise ConfigError(f"engine ({pool}): {err}") from None
        for pool in self.pools:
            self._check_tensor_parallel(pool)

    def _check_tensor_parallel(self, pool: Pool) -> None:
        tp = self.engine_config(pool).tensor_parallel_size
        if tp > 1 and self.mode == "disaggregated" and self.kv.transport == "nixl":
            raise ConfigError(
                f"pools.{pool}: tensor_parallel_size {tp} with kv.transport 'nixl' — the NIXL "
                "transport moves the KV of tp 1 replicas only; sharded replicas send each "
                "rank's KV heads over 'grpc' (or 'auto', which picks it for them)"
            )
        gpus = getattr(self, pool).num_gpus
        if tp > 1 and gpus and gpus != tp:
            raise ConfigError(
                f"pools.{pool}: a replica of tensor_parallel_size {tp} takes {tp} GPUs (one "
                f"per rank, of one node), but num_gpus is {gpus:g}"
            )

    @property
    def pools(self) -> list[Pool]:
        """The pools this mode runs, decode first (prefill streams into decode)."""
        return [Pool.COLOCATED] if self.mode == "colocated" else [Pool.DECODE, Pool.PREFILL]

    @property
    def prefill_pool(self) -> Pool:
        """Where prompts are computed."""
        return Pool.COLOCATED if self.mode == "colocated" else Pool.PREFILL

    @property
    def decode_pool(self) -> Pool:
        """Where sequences decode."""
        return Pool.COLOCATED if self.mode == "colocated" else Pool.DECODE

    def engine_config(self, pool: Pool) -> EngineConfig:
        overrides = {**self.engine, **getattr(self, pool).engine}
        return EngineConfig(**overrides)

    def worker_options(self, pool: Pool) -> dict:
        return WorkerOptions(
            model=self.model,
            engine=self.engine_config(pool),
            kv=self.kv,
            torch_threads=self.torch_threads,
        ).to_dict()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        if not isinstance(data, dict):
            raise ConfigError("the config must be a mapping")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known - {"pools"} | ({"limits"} & set(data)))
        if unknown:
            raise ConfigError(f"unknown key(s): {', '.join(unknown)}")
        kwargs: dict[str, Any] = {
            k: v
            for k, v in data.items()
            if k in ("model", "mode", "engine", "torch_threads", "namespace")
        }
        pools = data.get("pools") or {}
        for name in pools:
            if name not in tuple(Pool):
                raise ConfigError(f"pools.{name}: unknown pool (prefill, decode, colocated)")
        for name, section in pools.items():
            kwargs[name] = _build(PoolConfig, section, f"pools.{name}")
        if "kv" in data:
            kwargs["kv"] = _build(KVTransferOptions, data["kv"], "kv")
        if "router" in data:
            router = dict(data["router"]) if isinstance(data["router"], dict) else data["router"]
            if isinstance(router, dict) and "limits" in router:
                kwargs["limits"] = _build(RouterLimits, router.pop("limits"), "router.limits")
            if isinstance(router, dict) and "routing" in router:
                kwargs["routing"] = _build(RoutingConfig, router.pop("routing"), "router.routing")
            kwargs["router"] = _build(RouterConfig, router, "router")
        for key, kind in (("slo", SLOConfig), ("planner", PlannerConfig)):
            if key in data:
                kwargs[key] = _build(kind, data[key], key)
        try:
            return cls(**kwargs)
        except TypeError as err:
            raise ConfigError(str(err)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as err:
            raise ConfigError(f"cannot read config {path}: {err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from None
        return cls.from_dict(data or {})


def _build(kind: type, section: Any, where: str):
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: must be a mapping")
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s): {', '.join(unknown)}")
    try:
        return kind(**section)
    except (ConfigError, EngineError, ValueError, TypeError) as err:
        raise ConfigError(f"{where}: {err}") from None
