"""A two-node Ray cluster on one machine, as a user would run one on two hosts: each node in
a network namespace of its own (its own address), the two joined by a veth pair, which is
the only traffic between them; nothing reaches any other address. The head in namespace A
(``.1``), a worker in B (``.2``); ``ray start`` with token authentication, as Ray 2.60 does
by default. Needs root and iproute2 (`ip netns`); ``skip_reason`` says when they are missing.

Processes run in a namespace through ``ip netns exec``: the test process stays outside, so
it talks to the cluster through commands it runs in A (``run_in_head``, ``spawn_in_head``).
Nothing here calls ``ray stop``, which would stop every Ray on the machine: each node's
processes are killed by namespace (``kill_node``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
RAY_PORT = 6379


def skip_reason() -> str | None:
    """Why the namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no iproute2 (`ip`) here"
    return None


class TwoNodeCluster:
    def __init__(self, head_args: list[str], worker_args: list[str]) -> None:
        tag = f"{os.getpid() % 100000}"
        self.namespaces = (f"pdc{tag}a", f"pdc{tag}b")
        self._veth = (f"pdv{tag}a", f"pdv{tag}b")
        subnet = f"10.213.{os.getpid() % 250 + 1}"
        self.addresses = (f"{subnet}.1", f"{subnet}.2")
        self.head_args, self.worker_args = head_args, worker_args
        self.temp_dir = tempfile.mkdtemp(prefix="pdc-netns-", dir="/tmp")
        self.env = {
            **os.environ,
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "RAY_ADDRESS": "",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "PDCLUSTER_STATE": f"{self.temp_dir}/serve.json",
        }
        # the test session's loopback-only setting would refuse a second node
        self.env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)

    @property
    def head_address(self) -> str:
        return f"{self.addresses[0]}:{RAY_PORT}"

    # ---- the network ----------------------------------------------------------------------
    def up(self) -> TwoNodeCluster:
        a, b = self.namespaces
        va, vb = self._veth
        steps = [
            ["ip", "netns", "add", a],
            ["ip", "netns", "add", b],
            ["ip", "link", "add", va, "type", "veth", "peer", "name", vb],
            ["ip", "link", "set", va, "netns", a],
            ["ip", "link", "set", vb, "netns", b],
            ["ip", "-n", a, "addr", "add", f"{self.addresses[0]}/24", "dev", va],
            ["ip", "-n", b, "addr", "add", f"{self.addresses[1]}/24", "dev", vb],
        ]
        for ns, dev in ((a, va), (b, vb)):
            steps += [["ip", "-n", ns, "link", "set", "lo", "up"]]
            steps += [["ip", "-n", ns, "link", "set", dev, "up"]]
        try:
            for step in steps:
                subprocess.run(step, check=True, capture_output=True, text=True, timeout=30)
            self.start_node(0)
            self.start_node(1)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        for index in (0, 1):
            self.kill_node(index)
        for ns in self.namespaces:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    # ---- Ray nodes -------------------------------------------------------------------------
    def start_node(self, index: int) -> None:
        """``ray start`` node ``index`` (0: the head) in its namespace."""
        common = [
            f"--node-ip-address={self.addresses[index]}",
            f"--temp-dir={self.temp_dir}/ray{index}",
            "--disable-usage-stats",
        ]
        if index == 0:
            args = ["--head", f"--port={RAY_PORT}", "--include-dashboard=false", *self.head_args]
        else:
            args = [f"--address={self.head_address}", *self.worker_args]
        self.run(index, ["ray", "start", *args, *common], timeout=120)

    def kill_node(self, index: int) -> None:
        """Every process of node ``index`` at once (SIGKILL), as when a host is lost."""
        pids = subprocess.run(
            ["ip", "netns", "pids", self.namespaces[index]], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    # ---- commands in a namespace ----------------------------------------------------------
    def command(self, index: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[index], *argv]

    def run(self, index: int, argv: list[str], timeout: float = 120) -> str:
        done = subprocess.run(
            self.command(index, argv), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(f"{argv[:3]} in node {index} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def spawn(self, index: int, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(
            self.command(index, argv),
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            **kwargs,
        )

    def python(self, index: int, code: str, timeout: float = 120) -> str:
        return self.run(index, [sys.executable, "-c", code], timeout=timeout)

    def wait_for(self, predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
