"""The pieces of ``pdcluster bench kernels`` (benchmarks/gpu_kernels.py) that are not about
one kernel: a result row, timing a call on its device, checking it against its reference,
and the printed table."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Row:
    kernel: str
    shape: str
    check: str  # PASS (max err) / FAIL (max err) / -
    ours: float | None  # our kernel's number (TFLOP/s or GB/s)
    baseline: float | None  # torch's
    unit: str
    target: str = ""

    @property
    def ratio(self) -> float | None:
        if self.ours is None or not self.baseline:
            return None
        return self.ours / self.baseline


def time_call(fn, device, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds per call."""
    import torch

    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
    else:
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def check_close(name: str, got, want, atol: float, rtol: float) -> str:
    err = (got.float() - want.float()).abs()
    bound = atol + rtol * want.float().abs()
    ok = bool((err <= bound).all())
    return f"{'PASS' if ok else 'FAIL'} {err.max().item():.1e}"


def format_table(rows: list[Row]) -> str:
    lines = [
        f"{'kernel':<32} {'shape':<28} {'check':<14} {'ours':>9} {'baseline':>9} {'ratio':>7}  unit / target"
    ]
    for r in rows:
        ours = "-" if r.ours is None else f"{r.ours:9.1f}"
        base = "-" if r.baseline is None else f"{r.baseline:9.1f}"
        ratio = "-" if r.ratio is None else f"{r.ratio:6.2f}x"
        lines.append(
            f"{r.kernel:<32} {r.shape:<28} {r.check:<14} {ours:>9} {base:>9} {ratio:>7}  {r.unit} {r.target}"
        )
    return "\n".join(lines)
