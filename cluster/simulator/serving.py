"""What the served path adds to the engine's own forward passes, as the simulator models it.

The cost model times a bare engine step. A served request also pays, on its way to the
first token, the HTTP call, the router's KV reservation, the prefill call, the end of the
KV stream and the decode side's admission and first-token delivery (``request_s``); its
prefill step also ships every layer's KV (copies, fp8 quantisation, the sender's threads
sharing the GIL: ``prefill_factor``); its decode step also publishes tokens to the outbox
that the router's poll thread drains (``decode_factor``).

Where the pools share a host's CPU cores with the router and the load generator (this
development machine: 2 cores for everything), they also wait for the CPU. That is modelled
as processor sharing: every busy engine loop wants one core, the router, Ray and the load
generator want ``background_cpu_s`` core-seconds per second plus ``cpu_per_token_s`` per
output token delivered; when the wanted cores exceed ``cores``, every engine step runs
slower by the ratio (:func:`cpu_slowdown`). ``cores = 0`` means nothing is shared (each
replica has its own device): no slowdown, as on a GPU cluster.

The defaults add nothing (``NO_OVERHEADS``): the GPU presets and every result computed
before these terms existed are unchanged.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServingOverheads:
    """Serving-path terms; each says what it adds and all default to "nothing".

    - ``request_s``: seconds per request between its prefill's end and its first token at
      the client, beyond the KV transfer (reservation, RPCs, admission, delivery).
    - ``prefill_factor``, ``decode_factor``: served step time ÷ the engine's (>= 1 means
      slower), before any CPU contention.
    - ``cores``: CPU cores the engine loops, the router and the load generator share;
      0 = not shared (no contention).
    - ``background_cpu_s``: core-seconds per second the router, Ray and the load generator
      use while idle; ``cpu_per_token_s``: CPU seconds per output token delivered to the
      client (router, poll, load generator), beyond the engine step.
    """

    request_s: float = 0.0
    prefill_factor: float = 1.0
    decode_factor: float = 1.0
    cores: float = 0.0
    background_cpu_s: float = 0.0
    cpu_per_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("request_s", "cores", "background_cpu_s", "cpu_per_token_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        for name in ("prefill_factor", "decode_factor"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be finite and > 0, got {value}")

    @property
    def shares_cpu(self) -> bool:
        return self.cores > 0

    def describe(self) -> str:
        text = (
            f"request +{self.request_s * 1e3:.1f} ms, prefill x{self.prefill_factor:.2f}, "
            f"decode x{self.decode_factor:.2f}"
        )
        if self.shares_cpu:
            text += (
                f", {self.cores:g} cores shared with {self.background_cpu_s:.2f} cores of "
                f"background + {self.cpu_per_token_s * 1e3:.2f} ms CPU per token"
            )
        return text

    def to_json(self, path: str | Path, **notes) -> None:
        """Write the terms (and ``notes``: how they were fitted) as JSON."""
        Path(path).write_text(json.dumps({**asdict(self), "notes": notes}, indent=1) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> ServingOverheads:
        data = json.loads(Path(path).read_text())
        return cls(**{k: float(v) for k, v in data.items() if k != "notes"})


NO_OVERHEADS = ServingOverheads()


def cpu_slowdown(o: ServingOverheads, busy_loops: int, token_rate: float) -> float:
    """How much slower every engine step runs when ``busy_loops`` engine loops (one core
    each) share ``o.cores`` with the background work, and the decode loops would deliver
    ``token_rate`` tokens/s if nothing waited for the CPU (>= 1; 1 when not shared).

    Processor sharing: wanted cores D(s) = busy_loops + background_cpu_s +
    cpu_per_token_s · token_rate / s (tokens come s times slower when steps do), and
    s = max(1, D(s) / cores): the positive root of cores·s² − (loops + bg)·s − c·rate = 0.
    """
    if busy_loops < 0 or token_rate < 0:
        raise ValueError("busy_loops and token_rate must be >= 0")
    if not o.shares_cpu or busy_loops == 0:
        return 1.0
    fixed = busy_loops + o.background_cpu_s
    per_token = o.cpu_per_token_s * token_rate
    if fixed + per_token <= o.cores:
        return 1.0
    return (fixed + math.sqrt(fixed * fixed + 4.0 * o.cores * per_token)) / (2.0 * o.cores)
