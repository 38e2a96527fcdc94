"""Where a served run's time goes: snapshots of a running pdcluster, taken before and after
a `pdcluster bench serve` run, whose difference the simulator's serving overheads are read
from (``python -m benchmarks.sim_bench calibrate-serve``).

    python -m benchmarks.serve_probe snapshot --state STATE_FILE --out FILE

A snapshot holds each worker actor's ``stats()`` (engine steps, prefill transfer seconds,
KV receiver counters) and the CPU seconds (user + system, from /proc) of every process in
the server's process tree, grouped by what the process is (decode actor, prefill actor,
router, controller, Ray's own daemons, the ``pdcluster serve`` driver), the machine's
busy CPU seconds, and the wall clock it was taken at. Linux only (/proc); reads, changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")

# Process command lines → group names (first match wins). Ray names actor processes
# "ray::<Class>" once they host an actor.
GROUPS = (
    ("ray::DecodeWorker", "decode"),
    ("ray::ColocatedWorker", "colocated"),
    ("ray::PrefillWorker", "prefill"),
    ("ray::RouterActor", "router"),
    ("ray::Router", "router"),
    ("ray::Controller", "controller"),
    ("ray::", "ray_daemons"),  # DashboardAgent, RuntimeEnvAgent, idle workers
    ("raylet", "ray_daemons"),
    ("gcs_server", "ray_daemons"),
    ("ray/", "ray_daemons"),
    ("pdcluster serve", "serve_driver"),
    ("cluster serve", "serve_driver"),
)


def _proc_table() -> dict[int, tuple[int, str, float]]:
    """pid → (parent pid, command line, CPU seconds) for every readable process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        ppid, utime, stime = int(fields[1]), int(fields[11]), int(fields[12])
        table[int(entry.name)] = (ppid, cmdline, (utime + stime) / CLK_TCK)
    return table


def _descendants(root: int, table: dict[int, tuple[int, str, float]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    seen, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(children.get(pid, []))
    return seen


def group_of(cmdline: str) -> str:
    """The group a process belongs to, by its command line ("other" if none matches)."""
    for needle, group in GROUPS:
        if needle in cmdline:
            return group
    return "other"


def cpu_by_group(root_pid: int) -> dict[str, float]:
    """CPU seconds so far of ``root_pid`` and its descendants, summed per group."""
    table = _proc_table()
    out: dict[str, float] = {}
    for pid in _descendants(root_pid, table):
        if pid in table:
            _, cmdline, cpu = table[pid]
            group = group_of(cmdline)
            out[group] = out.get(group, 0.0) + cpu
    return out


def host_cpu_s() -> float:
    """CPU seconds all cores of the machine have been busy since boot (/proc/stat): with
    the server's and the load generator's own, it shows what other jobs took meanwhile."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def actor_stats(ray_address: str, namespace: str) -> dict[str, dict]:
    """``stats()`` of every prefill, decode and colocated actor of the running cluster."""
    from cluster.ray_env import prepare_ray_environment

    prepare_ray_environment(None)
    prepare_ray_environment(ray_address)
    import ray

    ray.init(address=ray_address, namespace=namespace, log_to_driver=False, logging_level="ERROR")
    try:
        controller = ray.get_actor("controller", namespace=namespace)
        status = ray.get(controller.status.remote(), timeout=30)
        names = [r["name"] for replicas in status["pools"].values() for r in replicas]
        handles = {n: ray.get_actor(n, namespace=namespace) for n in names}
        return {n: ray.get(h.stats.remote(), timeout=30).to_dict() for n, h in handles.items()}
    finally:
        ray.shutdown()


def snapshot(state_file: str) -> dict:
    """Actor stats and per-group CPU seconds of the server recorded in ``state_file``
    (what `pdcluster serve` writes; its ``pid`` is the process tree's root)."""
    state = json.loads(Path(state_file).read_text())
    stats = actor_stats(state["ray_address"], state.get("namespace", "pdcluster"))
    # CPU after the Ray calls, wall clock between: the probe's own calls are a few ms.
    return {
        "wall_s": time.monotonic(),
        "cpu_s": cpu_by_group(state["pid"]),
        "host_cpu_s": host_cpu_s(),
        "actors": stats,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot")
    s.add_argument("--state", required=True, help="the state file `pdcluster serve` wrote")
    s.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    Path(args.out).write_text(json.dumps(snapshot(args.state), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
