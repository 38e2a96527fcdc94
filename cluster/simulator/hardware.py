"""Accelerator presets: what the roofline cost model needs to know about one device.

Numbers are the vendors' dense peaks (no sparsity) for 16-bit tensor math, HBM bandwidth,
device memory, and the bandwidth a KV transfer between two replicas gets (inter-node
InfiniBand/RoCE per GPU, since prefill and decode replicas usually sit on different nodes;
intra-node NVLink is far faster and set with ``intra_node_link_bw``).

``CPU`` is this development machine as the tiny model uses it: one core per worker
(``torch_threads: 1``), fp32 AVX2 FMA, loopback gRPC for KV. Its peaks are rough; its real
speed comes from :func:`cluster.simulator.cost_model.calibrate` with measured numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Hardware:
    """One device. Bandwidths in bytes/s, compute in FLOP/s, memory in bytes."""

    name: str
    peak_flops: float  # dense, in the serving dtype
    mem_bw: float
    mem_bytes: float
    link_bw: float  # KV transfer bandwidth between replicas (per device)
    intra_node_link_bw: float = 0.0  # NVLink-class, for tensor parallel and same-node KV
    link_latency_s: float = 20e-6
    # Per step of a ring all-reduce within a node: NCCL's low-latency protocol over NVLink,
    # ~20 us for a small all-reduce over 8 GPUs (14 steps).
    allreduce_hop_s: float = 1.5e-6
    gpus_per_node: int = 8
    cost_per_hour: float = 1.0  # relative; GPU-hours are what `plan` minimises

    def __post_init__(self) -> None:
        for name in ("peak_flops", "mem_bw", "mem_bytes", "link_bw"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{self.name}: {name} must be positive")

    def with_(self, **changes) -> Hardware:
        return replace(self, **changes)


GB = 1e9
TB = 1e12

PRESETS: dict[str, Hardware] = {
    # A100 SXM 80 GB: 312 TFLOP/s bf16, 2.04 TB/s; HDR InfiniBand 200 Gb/s per GPU.
    "A100": Hardware("A100", 312e12, 2.039 * TB, 80 * GB, 25 * GB, 600 * GB),
    # H100 SXM 80 GB: 989 TFLOP/s bf16, 3.35 TB/s; NDR 400 Gb/s per GPU.
    "H100": Hardware("H100", 989e12, 3.35 * TB, 80 * GB, 50 * GB, 900 * GB, cost_per_hour=1.6),
    # H200 SXM 141 GB: H100's compute, 4.8 TB/s HBM3e.
    "H200": Hardware("H200", 989e12, 4.8 * TB, 141 * GB, 50 * GB, 900 * GB, cost_per_hour=2.0),
    # This machine, one core per worker: ~2.5 GHz x 2 FMA x 8 fp32 lanes; ~15 GB/s of DRAM
    # for one core; loopback gRPC ~1 GB/s. Calibrate before trusting.
    # Its ranks all-reduce through shared memory: ~30 us for 2 ranks (engine.shm_allreduce).
    "CPU": Hardware(
        "CPU",
        80e9,
        15 * GB,
        8 * GB,
        1 * GB,
        1 * GB,
        50e-6,
        15e-6,
        gpus_per_node=1,
        cost_per_hour=0.05,
    ),  # fmt: skip
}


def hardware(name: str) -> Hardware:
    """A preset by name (case-insensitive)."""
    key = name.upper()
    if key not in PRESETS:
        raise ValueError(f"unknown hardware {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[key]
