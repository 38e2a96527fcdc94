"""Options every serving worker takes, validated once, passed to Ray actors as plain dicts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.errors import EngineError
from engine.named_models import DEFAULT_MODEL


@dataclass(frozen=True)
class KVTransferOptions:
    token: str = ""  # shared secret of the KV channel; generated at start-up when empty
    wire_dtype: str = "fp8"  # fp8 | passthrough
    lease_timeout_s: float = 30.0
    max_frames_in_flight: int = 8
    host: str = "127.0.0.1"  # where decode workers' KV receivers listen
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    # Opt-in: kv frames over a second, raw TCP port negotiated in the gRPC handshake (same
    # token, optional TLS); ~2x loopback throughput, but the port must be reachable.
    data_channel: bool = False

    def __post_init__(self) -> None:
        if self.wire_dtype not in ("fp8", "passthrough"):
            raise EngineError(f"kv wire_dtype must be fp8 or passthrough, got {self.wire_dtype!r}")
        if self.lease_timeout_s <= 0:
            raise EngineError("kv lease_timeout_s must be positive")
        if self.max_frames_in_flight < 1:
            raise EngineError("kv max_frames_in_flight must be at least 1")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise EngineError("kv TLS needs both a certificate and a key")


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
