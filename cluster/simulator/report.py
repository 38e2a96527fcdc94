"""Text and PNG reports of simulations (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cluster.simulator.result import SimResult


def recovery_time(result: SimResult, after_s: float, level: float | None = None) -> float:
    """Seconds from ``after_s`` until the per-interval attainment (both SLOs) is back at
    ``level`` (default: the SLO percentile) and stays there for three intervals; NaN if
    never. Per interval = the requests that *arrived* in it (so a backlog counts)."""
    level = result.config.slo.percentile / 100.0 if level is None else level
    series = windowed_attainment(result)
    times = [t for t, _ in series if t >= after_s]
    values = [v for t, v in series if t >= after_s]
    for i in range(len(values) - 2):
        if all(v >= level for v in values[i : i + 3] if not math.isnan(v)):
            return times[i] - after_s
    return math.nan


def windowed_attainment(
    result: SimResult, window_s: float | None = None
) -> list[tuple[float, float]]:
    """(window end, fraction of that window's arrivals meeting both SLOs)."""
    window_s = window_s or result.config.planner.interval_s
    if not len(result.arrival_s):
        return []
    bins = (result.arrival_s // window_s).astype(np.int64)
    ok = result.meets_slo()
    n = int(bins.max()) + 1
    total = np.bincount(bins, minlength=n)
    good = np.bincount(bins, weights=ok, minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = good / total
    return [((i + 1) * window_s, float(frac[i]) if total[i] else math.nan) for i in range(n)]


def format_simulation(result: SimResult) -> str:
    s = result.summary()
    p = result.config.slo.percentile
    lines = [
        f"requests {s['requests']:,} (finished {s['finished']:,}), SLO attainment "
        f"{s['attainment']:.1%} (TTFT ≤ {result.config.slo.ttft_ms:g} ms and TPOT ≤ "
        f"{result.config.slo.tpot_ms:g} ms)",
        f"TTFT p50 {s['ttft_p50_ms']:.0f} ms, p{p:g} {s[f'ttft_p{p:g}_ms']:.0f} ms; "
        f"TPOT p50 {s['tpot_p50_ms']:.1f} ms, p{p:g} {s[f'tpot_p{p:g}_ms']:.1f} ms",
        f"GPU-hours {s['gpu_hours']:.2f} over {result.end_s / 3600:.2f} h; scaling actions "
        f"{s['scaling_actions']}",
    ]
    for pool in result.config.pools:
        sizes = [row[pool] for row in result.ticks if pool in row]
        if sizes:
            lines.append(
                f"{pool}: replicas min {min(sizes)}, max {max(sizes)}, mean {np.mean(sizes):.1f}"
            )
    return "\n".join(lines)


def plot_simulation(result: SimResult, path: str) -> None:
    """Replicas per pool, arrival rate, and per-interval attainment over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ticks = result.ticks
    hours = np.array([row["time_s"] for row in ticks]) / 3600
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for pool in result.config.pools:
        axes[0].step(hours, [row.get(pool, 0) for row in ticks], where="post", label=pool)
    ups = [d for d in result.decisions if d.direction == "up"]
    downs = [d for d in result.decisions if d.direction == "down"]
    axes[0].scatter(
        [d.time_s / 3600 for d in ups], [d.target for d in ups], marker="^", s=12, c="g"
    )
    axes[0].scatter(
        [d.time_s / 3600 for d in downs], [d.target for d in downs], marker="v", s=12, c="r"
    )
    axes[0].set_ylabel("replicas")
    axes[0].legend()
    axes[1].plot(hours, [row["arrival_rate"] for row in ticks])
    axes[1].set_ylabel("arrivals (req/s)")
    series = windowed_attainment(result)
    axes[2].plot([t / 3600 for t, _ in series], [v for _, v in series])
    axes[2].axhline(result.config.slo.percentile / 100, ls="--", c="gray")
    axes[2].set_ylabel("SLO attainment")
    axes[2].set_xlabel("hours")
    axes[0].set_title(
        f"{result.summary()['gpu_hours']:.1f} GPU-hours, attainment {result.attainment():.1%}, "
        f"{len(result.decisions)} scaling actions"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_attainment(
    curves: dict[str, tuple[Sequence[float], Sequence[float]]], target: float, path: str
) -> None:
    """Attainment against rate per GPU, one line per deployment (label → (x, y))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (x, y) in curves.items():
        ax.plot(x, y, marker="o", label=label)
    ax.axhline(target, ls="--", c="gray", label=f"target {target:.0%}")
    ax.set_xlabel("rate per GPU (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
