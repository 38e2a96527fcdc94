"""The KV transfer options of a worker (the ``kv`` section of a cluster config), validated once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.errors import EngineError


@dataclass(frozen=True)
class KVTransferOptions:
    transport: str = "grpc"  # grpc | nixl | auto (NIXL where both sides have it)
    token: str = ""  # shared secret of the KV channel; generated at start-up when empty
    wire_dtype: str = "fp8"  # fp8 | passthrough
    lease_timeout_s: float = 30.0
    max_frames_in_flight: int = 8
    # Where decode workers' KV receivers listen, and the address prefill workers dial: "auto"
    # is the node's own (Ray's node IP, so a prefill on another node reaches it; loopback
    # outside Ray); "0.0.0.0" listens on every interface and advertises the node's IP; any
    # other address is bound and advertised as given (one value for every node).
    host: str = "auto"
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    # gRPC: the kv frames of a transfer of at least data_channel_min_bytes go over a second,
    # raw TCP port negotiated in the gRPC handshake (same token, optional TLS): ~2x gRPC's
    # throughput (60-68% of a raw socket on loopback, against ~30%). A sender that cannot
    # reach the port sends over gRPC instead (and stops asking for a minute). Below ~4 MiB
    # the connection costs more than it saves (loopback: 2 MiB took 15 ms with it, 11 ms
    # without; 8 MiB 11 against 14 ms).
    data_channel: bool = True
    data_channel_min_bytes: int = 4 << 20
    # A prefill ships finished layers' KV once this many bytes of them (in the cache's dtype)
    # are ready, and at each step's last layer; 0: every layer the moment it is done. Each
    # send wakes the sending threads, which then compete with the forward for the GIL and
    # the cores (smollm2-135m's 128-token prompt, 30 layers of ~100 kB: 88 ms layer by layer,
    # 79 ms in one burst, 72 ms with no KV sent; 2 cores); a burst's layers go in one call
    # and frame. Bursts of ~6 layers there rather than one at the end: what was sent while
    # later layers computed is not left for after the step (served at 0.3 req/s, the
    # transfer's tail 2.1-2.4 ms against 5.5-15.3 with one burst, TTFT p50 113-116 against
    # 116-135 ms). A long prompt's layers (1.3 MB each at 1,676 tokens) go one by one.
    layer_burst_bytes: int = 512 << 10

    def __post_init__(self) -> None:
        from kv_transfer.connector import transport_names

        if self.transport not in transport_names():
            known = ", ".join(transport_names())
            raise EngineError(f"kv transport must be one of {known}, got {self.transport!r}")
        if self.transport == "nixl":
            from kv_transfer.nixl_agent import nixl_unavailable

            if (why := nixl_unavailable()) is not None:
                raise EngineError(f"kv transport nixl: {why}")
        if self.wire_dtype not in ("fp8", "passthrough"):
            raise EngineError(f"kv wire_dtype must be fp8 or passthrough, got {self.wire_dtype!r}")
        if self.lease_timeout_s <= 0:
            raise EngineError("kv lease_timeout_s must be positive")
        if self.layer_burst_bytes < 0:
            raise EngineError("kv layer_burst_bytes must be 0 or more")
        if self.data_channel_min_bytes < 0:
            raise EngineError("kv data_channel_min_bytes must be 0 or more")
        if self.max_frames_in_flight < 1:
            raise EngineError("kv max_frames_in_flight must be at least 1")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise EngineError("kv TLS needs both a certificate and a key")
        if not isinstance(self.host, str) or not self.host.strip():
            raise EngineError(f"kv host must be 'auto' or an address, got {self.host!r}")

    def bind_host(self) -> str:
        """The address a receive side binds: ``host``, or the node's own for ``auto``."""
        return node_address() if self.host == "auto" else self.host

    def advertised_host(self) -> str:
        """The address a receive side tells senders to dial (never a wildcard)."""
        bound = self.bind_host()
        return node_address() if bound in WILDCARDS else bound

    def on_this_node(self) -> KVTransferOptions:
        """These options with ``auto`` resolved here, for processes that cannot ask Ray
        (a tensor-parallel replica's ranks 1..t-1 are children of the actor)."""
        if self.host != "auto":
            return self
        return dataclasses.replace(self, host=node_address())


WILDCARDS = ("0.0.0.0", "::", "[::]")


def node_address() -> str:
    """This process's node address as the cluster knows it: Ray's node IP inside a Ray
    driver or worker (``ray start --node-ip-address``, else what Ray detected), loopback
    outside Ray (one process, or tests)."""
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return "127.0.0.1"
