"""The cluster config: a YAML file (or the embedded default), validated into dataclasses.
Errors name the bad key (``pools.decode.replicas: must be >= 1``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.config import EngineConfig
from engine.errors import EngineError
from engine.worker_options import KVTransferOptions, WorkerOptions
from router.config import RouterConfig


class ConfigError(ValueError):
    """The cluster config is invalid; the message names the key."""


@dataclass(frozen=True)
class PoolConfig:
    replicas: int = 1
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    engine: dict = field(default_factory=dict)  # EngineConfig overrides for this pool

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ConfigError(f"replicas: must be an integer >= 1, got {self.replicas!r}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ConfigError("num_cpus and num_gpus must be >= 0")


@dataclass(frozen=True)
class ClusterConfig:
    model: str = "tiny"
    mode: str = "disaggregated"  # or colocated
    engine: dict = field(default_factory=dict)  # EngineConfig fields shared by every pool
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    colocated: PoolConfig = field(default_factory=PoolConfig)
    kv: KVTransferOptions = field(default_factory=KVTransferOptions)
    router: RouterConfig = field(default_factory=RouterConfig)
    torch_threads: int | None = 1  # per worker on CPU: two workers on two cores must not fight
    namespace: str = "pdcluster"

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ConfigError(f"mode: must be 'disaggregated' or 'colocated', got {self.mode!r}")
        for pool in ("prefill", "decode", "colocated"):
            try:
                self.engine_config(pool)
            except (EngineError, TypeError) as err:
                raise ConfigError(f"engine ({pool}): {err}") from None

    def engine_config(self, pool: str) -> EngineConfig:
        overrides = {**self.engine, **getattr(self, pool).engine}
        return EngineConfig(**overrides)

    def worker_options(self, pool: str) -> dict:
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
        unknown = sorted(set(data) - known - {"pools"})
        if unknown:
            raise ConfigError(f"unknown key(s): {', '.join(unknown)}")
        kwargs: dict[str, Any] = {
            k: v
            for k, v in data.items()
            if k in ("model", "mode", "engine", "torch_threads", "namespace")
        }
        pools = data.get("pools") or {}
        for name in pools:
            if name not in ("prefill", "decode", "colocated"):
                raise ConfigError(f"pools.{name}: unknown pool (prefill, decode, colocated)")
        for name, section in pools.items():
            kwargs[name] = _build(PoolConfig, section, f"pools.{name}")
        if "kv" in data:
            kwargs["kv"] = _build(KVTransferOptions, data["kv"], "kv")
        if "router" in data:
            kwargs["router"] = _build(RouterConfig, data["router"], "router")
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
