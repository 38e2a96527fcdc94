"""Options every serving worker takes, validated once, passed to Ray actors as plain dicts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.named_models import DEFAULT_MODEL
from kv_transfer.options import KVTransferOptions


@dataclass(frozen=True)
class WorkerOptions:
    model: str = DEFAULT_MODEL
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv: KVTransferOptions = field(default_factory=KVTransferOptions)
    torch_threads: int | None = None  # CPU threads per worker; None = torch's default

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> WorkerOptions:
        return cls(
            model=data["model"],
            engine=EngineConfig(**data["engine"]),
            kv=KVTransferOptions(**data["kv"]),
            torch_threads=data.get("torch_threads"),
        )
