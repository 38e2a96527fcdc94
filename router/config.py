"""Options of the router's API servers (HTTP and gRPC), validated at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    """``api_key`` None means no authentication. ``served_model_name`` None serves the
    backend's model name. ``grpc_port`` None runs no gRPC server; 0 picks a free port."""

    host: str = "127.0.0.1"  # loopback by default: exposing the API is an explicit choice
    port: int = 8000
    grpc_port: int | None = 50051
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 8 * 2**20  # a 128k-token id prompt is ~1 MiB of JSON
    max_tokens_limit: int = 32768  # largest max_tokens a request may ask for
    default_max_tokens: int = 16  # /v1/completions default, as OpenAI's
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_prompts_per_request: int = 64  # /v1/completions with a list of prompts
    max_n: int = 16  # choices per prompt (OpenAI's n)
    # How long an idle HTTP connection stays open. Longer than clients' pools keep one
    # (httpx 5 s, aiohttp 15 s, proxies ~60 s): a server that closes first races a client
    # reusing the connection, which then sees its request reset (uvicorn's default is 5 s).
    keep_alive_s: float = 75.0

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        for name in ("port", "grpc_port"):
            value = getattr(self, name)
            if value is None and name == "grpc_port":
                continue
            if not isinstance(value, int) or not 0 <= value <= 65535:
                raise ValueError(f"{name} must be a port number in [0, 65535], got {value!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must be a non-empty string or None")
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name must be non-empty or None")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_tokens_limit < 1:
            raise ValueError("max_tokens_limit must be positive")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError("default_max_tokens must be in [1, max_tokens_limit]")
        if self.max_prompts_per_request < 1 or self.max_n < 1:
            raise ValueError("max_prompts_per_request and max_n must be at least 1")
        if not self.keep_alive_s > 0:
            raise ValueError(f"keep_alive_s must be positive, got {self.keep_alive_s!r}")
        if self.max_stop_strings < 0 or self.max_stop_string_len < 1:
            raise ValueError("max_stop_strings must be >= 0 and max_stop_string_len >= 1")


@dataclass(frozen=True)
class RouterLimits:
    """Admission limits: past them a request is refused at once (429 with Retry-After)
    rather than queued without bound. With ``slo_admission`` (and SLO targets given to the
    backend) a request is also refused at once when its forecast TTFT misses the target,
    and a decode replica takes no more requests than keep its TPOT under target."""

    # Shallow by default: past these a client hears 429 at once and can retry elsewhere,
    # instead of queueing into latencies no SLO allows.
    max_waiting: int = 64  # requests waiting for decode KV capacity
    queue_timeout_s: float = 10.0  # longest such wait before a 429
    max_prefill_queue_tokens: int = 65_536  # prompt tokens queued on the prefill pool
    max_attempts: int = 3  # prefill retries / decode migrations per request
    idle_timeout_s: float = 120.0  # no token for this long: the attempt is abandoned and retried
    replica_wait_s: float = (
        5.0  # with no replica ready (one being replaced), wait this long before a 503
    )
    # SLO-aware admission (router/admission.py) against the cluster's ``slo`` targets:
    # adaptive per-replica decode limits for TPOT, early 429 for a forecast TTFT miss.
    slo_admission: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.slo_admission, bool):
            raise ValueError(f"slo_admission must be true or false, got {self.slo_admission!r}")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if self.queue_timeout_s < 0 or self.idle_timeout_s <= 0 or self.replica_wait_s < 0:
            raise ValueError("queue_timeout_s and replica_wait_s must be >= 0, idle_timeout_s > 0")
        if self.max_prefill_queue_tokens < 1 or self.max_attempts < 1:
            raise ValueError("max_prefill_queue_tokens and max_attempts must be >= 1")


PREFILL_POLICIES = ("kv_aware", "least_loaded", "first_block_hash")


@dataclass(frozen=True)
class RoutingConfig:
    """How the router picks replicas (YAML: ``router.routing``). ``prefill``: kv_aware (what
    each replica's prefix cache holds against its backlog), least_loaded, or first_block_hash
    (router/prefill_routing.py)."""

    prefill: str = "kv_aware"
    # A decode replica whose own prefix cache holds all of a prompt but at most this many
    # tokens prefills them itself (no prefill replica, no transfer): "auto" = where its
    # measured prefill cost stays under the measured cost of a remote prefill's round trip;
    # 0 = never.
    decode_local_prefill: str | int = "auto"

    def __post_init__(self) -> None:
        if self.prefill not in PREFILL_POLICIES:
            raise ValueError(
                f"prefill must be one of {', '.join(PREFILL_POLICIES)}, got {self.prefill!r}"
            )
        local = self.decode_local_prefill
        if local != "auto" and (not isinstance(local, int) or isinstance(local, bool) or local < 0):
            raise ValueError(
                "decode_local_prefill must be 'auto' or a token count >= 0 (0: never), got "
                f"{local!r}"
            )

    @property
    def local_prefill_limit(self) -> int | None:
        """What a decode replica's ``reserve`` takes: None for its own measure."""
        return None if self.decode_local_prefill == "auto" else int(self.decode_local_prefill)
