"""A client that goes away cancels its request: the backend's generator is closed."""

from __future__ import annotations

import httpx
import pytest


def test_stream_disconnect_mid_stream(router, backend):
    backend.delay_s = 0.05
    with httpx.stream(
        "POST",
        f"{router.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 200, "stream": True},
    ) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
    assert backend.cancel_seen.wait(5), "the backend never saw the cancellation"
    assert backend.cancelled == [backend.calls[0].request_id]


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_before_first_token(router, backend, stream):
    backend.hang = True
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{router.url}/v1/completions", json={"prompt": "hi", "stream": stream}, timeout=0.3
        )
    assert backend.cancel_seen.wait(5), "the backend never saw the cancellation"
    assert len(backend.cancelled) == 1


def test_finished_requests_are_not_cancelled(router, backend):
    httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi", "stream": True})
    httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi", "stop": ["lo"]})
    assert backend.cancelled == [] and len(backend.finished) == 2
