"""`pdcluster serve` as a user runs it (no --model: the default real model): joining a
separately started `ray start --head` cluster with `--address auto`, serving a request, and
shutting down cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.conftest import free_port

BIN = Path(sys.executable).parent


def kill_ray_started_in(temp_dir: str) -> None:
    """Stop only the Ray processes of the cluster under ``temp_dir`` (``ray stop`` would
    also stop the test session's own Ray)."""
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or []):
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


@pytest.fixture
def ray_head():
    temp_dir = tempfile.mkdtemp(prefix="pdray-", dir="/tmp")
    port = free_port()
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    subprocess.run(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=120,
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        kill_ray_started_in(temp_dir)


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"pdcluster serve exited early:\n{process.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError("pdcluster serve did not become healthy")


def stream_forever(url: str, streaming: threading.Event) -> None:
    """A long streamed completion; sets ``streaming`` once tokens flow. Ends when the
    server goes away."""
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    streaming.set()
    except httpx.HTTPError:
        pass


def test_serve_joins_an_existing_cluster_and_stops_on_sigterm(ray_head, default_model_file):
    port, grpc_port = free_port(), free_port()
    # what `--address auto` resolves; the CLI finds the token `ray start` wrote itself
    env = {**os.environ, "RAY_ADDRESS": ray_head, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_AUTH_MODE", None)
    env.pop("TRITON_INTERPRET", None)
    process = subprocess.Popen(
        [
            str(BIN / "pdcluster"),
            "serve",
            "--address",
            "auto",
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    streams = []
    try:
        wait_healthy(url, process)
        body = {"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 5, "temperature": 0}
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
        # Streams in flight when the signal comes: shutdown must not wait for them.
        streaming = threading.Event()
        for _ in range(3):
            thread = threading.Thread(target=stream_forever, args=(url, streaming), daemon=True)
            thread.start()
            streams.append(thread)
        assert streaming.wait(60)
    finally:
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        output, _ = process.communicate(timeout=60)
        exit_s = time.monotonic() - signalled
    assert process.returncode == 0, output
    assert exit_s < 10, f"serve took {exit_s:.1f} s to exit on SIGTERM with streams in flight"
    assert "serving smollm2-135m" in output
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)
