"""The router keeps idle HTTP connections open for ``keep_alive_s``: longer than clients'
pools keep them, so a client never reuses a connection the server is closing (the race
that reset one request of a CI overload run: uvicorn's 5 s default equals httpx's)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from router import RouterConfig
from tests.router.conftest import LiveRouter
from tests.router.fake_backend import FakeBackend

REQUEST = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def get_health(sock: socket.socket) -> bytes:
    """One GET /health on ``sock``: the whole response (headers, then Content-Length bytes)."""
    sock.sendall(REQUEST)
    response = b""
    while b"\r\n\r\n" not in response:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {response!r}"
        response += chunk
    head, _, body = response.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head


def test_default_keep_alive_outlasts_the_clients_pools():
    assert RouterConfig().keep_alive_s > httpx.Limits().keepalive_expiry + 5
    assert RouterConfig().keep_alive_s > 15 + 5  # aiohttp's keepalive_timeout


def test_idle_connection_stays_open_for_keep_alive_s_then_closes():
    keep_alive_s = 2.0
    with LiveRouter(FakeBackend(), RouterConfig(keep_alive_s=keep_alive_s)) as router:
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
            assert get_health(sock).startswith(b"HTTP/1.1 200")
            time.sleep(0.5)  # idle, under keep_alive_s: the same connection serves again
            assert get_health(sock).startswith(b"HTTP/1.1 200")
            idle_from = time.monotonic()
            assert sock.recv(65536) == b""  # then the server closes it, once idle long enough
            assert time.monotonic() - idle_from >= keep_alive_s - 0.1


def test_keep_alive_must_be_positive():
    with pytest.raises(ValueError, match="keep_alive_s"):
        RouterConfig(keep_alive_s=0)
