"""``pdcluster status``: the pools, their replicas and load, SLO attainment and the planner's
last decisions, read from the running cluster's controller.

``pdcluster serve`` records where its Ray cluster is in ``~/.pdcluster/serve.json``;
``status`` reads it (or takes ``--address``) and asks the ``controller`` actor.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

STATE_FILE = Path(os.environ.get("PDCLUSTER_STATE", Path.home() / ".pdcluster" / "serve.json"))


def write_state(ray_address: str, urls: dict, namespace: str) -> None:
    STATE_FILE.parent.mkdir(parents=True, exist_ok=True)
    STATE_FILE.write_text(
        json.dumps(
            {"ray_address": ray_address, "urls": urls, "namespace": namespace, "pid": os.getpid()}
        )
    )


def clear_state() -> None:
    try:
        if json.loads(STATE_FILE.read_text()).get("pid") == os.getpid():
            STATE_FILE.unlink()
    except (OSError, ValueError):
        pass


def fetch_status(address: str | None) -> dict:
    """The controller's status dict. Raises RuntimeError when no cluster can be found."""
    namespace = "pdcluster"
    if address is None:
        try:
            state = json.loads(STATE_FILE.read_text())
        except (OSError, ValueError):
            raise RuntimeError(
                "no running pdcluster found (start one with `pdcluster serve`, or pass --address)"
            ) from None
        address, namespace = state["ray_address"], state.get("namespace", namespace)
    from cluster.ray_env import prepare_ray_environment

    if address.startswith("127.0.0.1:") or address.startswith("localhost:"):
        prepare_ray_environment(None)  # a local, loopback-only cluster
    prepare_ray_environment(address)
    import ray

    # Ray's driver prints the cluster's error messages (a node marked dead, ...) to stdout
    # from a thread of its own: on stderr, they cannot break `status --json`'s output.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            ray.init(
                address=address, namespace=namespace, log_to_driver=False, logging_level="ERROR"
            )
        except (ConnectionError, RuntimeError) as err:
            raise RuntimeError(f"cannot reach the Ray cluster at {address}: {err}") from None
        try:
            controller = ray.get_actor("controller", namespace=namespace)
            return ray.get(controller.status.remote(), timeout=30)
        except ValueError:
            raise RuntimeError(f"no pdcluster controller in the Ray cluster at {address}") from None
        finally:
            ray.shutdown()


def format_status(status: dict) -> str:
    lines = [
        f"pdcluster {status['mode']} serving {status['model']}  {status['urls'].get('http', '')}"
    ]
    slo = status["slo"]
    attainment = status.get("slo_attainment_60s")
    lines.append(
        f"SLO: TTFT p{slo['percentile']:g} <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms; "
        f"attainment (last 60 s): {'n/a' if attainment is None else f'{attainment:.1%}'}"
    )
    targets = status.get("targets", {})
    for pool, replicas in status["pools"].items():
        wanted = f", {targets[pool]} wanted" if pool in targets else ""
        lines.append(f"{pool} ({len(replicas)} replicas{wanted})")
        for r in replicas:
            if r["state"] == "pending":
                lines.append(
                    f"  {r['name']:<14} pending   for {r['waited_s']:>6.1f}s  {r['reason']}"
                )
                continue
            hit_rate = r.get("prefix_hit_rate")
            lines.append(
                f"  {r['name']:<14} {r['state']:<9} age {r['age_s']:>7.1f}s  "
                f"node {r.get('node') or '?':<15} running {r['running']:>3}  "
                f"queued {r['queued_tokens']:>6} tok  kv {r['kv_usage']:.0%}  "
                f"prefix hits {'-' if hit_rate is None else f'{hit_rate:.0%}'}"
            )
    lines.append(f"planner: {'on' if status['planner_enabled'] else 'off'}")
    for d in status.get("decisions", [])[-6:]:
        lines.append(f"  {d['pool']} {d['current']}→{d['target']}: {d['reason']}")
    for e in status.get("events", [])[-6:]:
        lines.append(f"  event [{e['kind']}] {e['message']}")
    return "\n".join(lines)


def add_status_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "status", help="pools, replicas, load, SLO attainment, planner decisions"
    )
    p.add_argument(
        "--address", help="Ray cluster address (default: the one `pdcluster serve` recorded)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_status)


def run_status(args) -> int:
    try:
        status = fetch_status(args.address)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2, default=str) if args.json else format_status(status))
    return 0
