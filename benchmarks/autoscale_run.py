"""pdcluster with Ray's real autoscaler, its nodes local processes (the ``fake_multinode``
provider, the stand-in for ``ray up``): a pool scaled past what the cluster holds gets a new
node and its replica lands there; scaled back, the node goes. Prints the timeline.

    python -m benchmarks.autoscale_run            # as root: runs in a network namespace

Everything runs in a network namespace of its own with only loopback (so every node's
address is 127.0.0.1, and nothing reaches any other address). The head has 2 CPUs (the
prefill and the first decode replica); a ``worker`` node type has 1 CPU, up to one node.
The decode pool is resized with the controller's ``scale`` (the path a planner decision
takes): up to 2 (a replica pending for a CPU: the autoscaler launches a worker, the replica
is placed on it), then back to 1 (drained; the request shrinks; the idle node is removed
after ``idle_timeout_minutes``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

NAMESPACE = "pdc-autoscale"
BIN = Path(sys.executable).parent
IDLE_TIMEOUT_MINUTES = 0.25


def autoscaling_config() -> dict:
    """A fake_multinode cluster YAML (the 2.60 wheel lacks Ray's own example.yaml)."""
    return {
        "cluster_name": "pdcluster-fake",
        "max_workers": 1,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": IDLE_TIMEOUT_MINUTES,
        "docker": {},
        "provider": {
            "type": "fake_multinode",
            "gcs_address": "127.0.0.1:6379",
            # as Ray's own example.yaml: local processes need no SSH set-up or update, and
            # every node has the same IP, so the autoscaler must tell them apart by node id
            # (by IP the head's use keeps the worker "in use": it is never removed)
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "use_node_id_as_ip": True,
        },
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 2}, "node_config": {}, "max_workers": 0},
            "worker": {
                "resources": {"CPU": 1},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 1,
            },
        },
        "head_node_type": "ray.head.default",
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def in_namespace() -> int:
    """Make the namespace (loopback only) and run this script again inside it."""
    remove_namespace()  # one an interrupted run left
    subprocess.run(["ip", "netns", "add", NAMESPACE], check=True)
    try:
        subprocess.run(["ip", "-n", NAMESPACE, "link", "set", "lo", "up"], check=True)
        env = {**os.environ, "PDCLUSTER_AUTOSCALE_INSIDE": "1"}
        command = ["ip", "netns", "exec", NAMESPACE, sys.executable, "-m", __spec__.name]
        return subprocess.call(command, env=env)
    finally:
        remove_namespace()


def remove_namespace() -> None:
    """Kill every process in the namespace (its Ray nodes), then remove it."""
    pids = subprocess.run(["ip", "netns", "pids", NAMESPACE], capture_output=True, text=True)
    for pid in pids.stdout.split():
        subprocess.run(["kill", "-9", pid])
    subprocess.run(["ip", "netns", "del", NAMESPACE], capture_output=True)


def run() -> int:
    temp = tempfile.mkdtemp(prefix="pdc-autoscale-")
    config_path = Path(temp) / "autoscaling.yaml"
    config_path.write_text(yaml.safe_dump(autoscaling_config()))
    os.environ.update(
        {
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            "PDCLUSTER_CPU_DTYPE": os.environ.get("PDCLUSTER_CPU_DTYPE", "float32"),
        }
    )
    os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    t0 = time.monotonic()

    def say(what: str) -> None:
        print(f"{time.monotonic() - t0:7.1f} s  {what}", flush=True)

    subprocess.run(
        [
            "ray", "start", "--head", "--port=6379", "--node-ip-address=127.0.0.1",
            "--num-cpus=2", f"--autoscaling-config={config_path}", f"--temp-dir={temp}/ray",
            "--include-dashboard=false", "--disable-usage-stats",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    say("head up (2 CPUs), autoscaler running")
    import ray

    from cluster.config import ClusterConfig
    from cluster.launcher import start_cluster, stop_cluster

    config = ClusterConfig.from_dict(
        {
            "model": "tiny",
            "engine": {"num_kv_blocks": 128},
            "pools": {
                "prefill": {"replicas": 1, "num_cpus": 1},
                "decode": {
                    "min_replicas": 1,
                    "initial_replicas": 1,
                    "max_replicas": 2,
                    "num_cpus": 1,
                },
            },
            "router": {"port": 8000, "grpc_port": None},
        }
    )
    running = start_cluster(config, address="127.0.0.1:6379", progress=lambda line: say(line))
    say(f"serving; nodes alive: {alive_nodes(ray)}")

    def decode() -> list[dict]:
        return ray.get(running.controller.status.remote())["pools"]["decode"]

    timeline: dict[str, float] = {}
    try:
        ray.get(running.controller.scale.remote("decode", 2))
        scaled_up = time.monotonic()
        say("decode scaled to 2")
        seen: set[str] = set()
        while time.monotonic() - scaled_up < 300:
            replica = next((r for r in decode() if r["name"] == "decode-1"), None)
            if replica is None:  # its bring-up failed: the controller brings up another
                events = ray.get(running.controller.status.remote())["events"]
                say(f"decode-1 gone: {events[-1]['message']}")
                time.sleep(0.5)
                continue
            nodes = alive_nodes(ray)
            key = f"{replica['state']} {replica['node']} nodes={nodes}"
            if key not in seen:
                seen.add(key)
                say(
                    f"decode-1 {replica['state']} {replica['reason'] or replica['node']}; nodes {nodes}"
                )
            if nodes == 2 and "node_up" not in timeline:
                timeline["node_up"] = time.monotonic() - scaled_up
            if replica["state"] in ("ready", "warming"):
                timeline["replica_ready"] = time.monotonic() - scaled_up
                break
            time.sleep(0.5)
        else:
            raise RuntimeError("decode-1 was never placed")
        on_new_node = head_node_id(ray) != node_id_of(ray, "decode-1")
        say(f"decode-1 ready on the new node: {on_new_node}")

        ray.get(running.controller.scale.remote("decode", 1))
        scaled_down = time.monotonic()
        say("decode scaled to 1")
        while decode_names(decode()) != ["decode-0"]:
            time.sleep(0.5)
        timeline["drained"] = time.monotonic() - scaled_down
        say("decode-1 drained and stopped")
        while alive_nodes(ray) > 1 and time.monotonic() - scaled_down < 300:
            time.sleep(0.5)
        timeline["node_removed"] = time.monotonic() - scaled_down
        final_nodes = alive_nodes(ray)
        say(f"nodes alive: {final_nodes}")
    finally:
        stop_cluster(running)
        ray.shutdown()
        # (no `ray stop`: it stops every Ray of the machine; the namespace's processes are
        # killed when it is removed)
        if not os.environ.get("PDCLUSTER_AUTOSCALE_KEEP"):
            shutil.rmtree(temp, ignore_errors=True)
    print(json.dumps({k: round(v, 1) for k, v in timeline.items()}))
    print(
        f"scale-up: node up {timeline['node_up']:.1f} s, replica ready "
        f"{timeline['replica_ready']:.1f} s after the decision (on the new node: {on_new_node}); "
        f"scale-down: drained {timeline['drained']:.1f} s, node removed "
        f"{timeline['node_removed']:.1f} s after (idle_timeout_minutes {IDLE_TIMEOUT_MINUTES})"
    )
    return 0 if on_new_node and final_nodes == 1 else 1


def decode_names(replicas: list[dict]) -> list[str]:
    return sorted(r["name"] for r in replicas)


def alive_nodes(ray) -> int:
    return sum(1 for n in ray.nodes() if n["Alive"])


def head_node_id(ray) -> str:
    return next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])


def node_id_of(ray, actor_name: str) -> str:
    handle = ray.get_actor(actor_name, namespace="pdcluster")
    return ray.get(handle.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def main() -> int:
    if os.environ.get("PDCLUSTER_AUTOSCALE_INSIDE"):
        return run()
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("needs root and iproute2 (it runs in a network namespace)", file=sys.stderr)
        return 2
    return in_namespace()


if __name__ == "__main__":
    sys.exit(main())
