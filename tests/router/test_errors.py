"""Auth, backend refusals (429 / 503 / 400) and their statuses, streaming or not."""

from __future__ import annotations

import httpx
import openai
import pytest

from router import NoReplica, Overloaded, RequestRejected, RouterConfig
from tests.router.conftest import LiveRouter
from tests.router.fake_backend import FakeBackend

BODY = {"prompt": "hi", "max_tokens": 4}


@pytest.fixture(scope="module")
def keyed_router():
    with LiveRouter(FakeBackend(), RouterConfig(api_key="sekrit")) as router:
        yield router


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "sekrit"},
        {"Authorization": "Basic sekrit"},
    ],
)
def test_401_without_the_key(keyed_router, headers):
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
        resp = httpx.request(method, f"{keyed_router.url}{path}", json=BODY, headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert keyed_router.backend.calls == []


def test_key_accepted_and_open_endpoints(keyed_router):
    resp = httpx.post(
        f"{keyed_router.url}/v1/completions", json=BODY, headers={"Authorization": "Bearer sekrit"}
    )
    assert resp.status_code == 200
    client = openai.OpenAI(base_url=f"{keyed_router.url}/v1", api_key="sekrit", max_retries=0)
    assert (
        client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text == "He"
    )
    bad = openai.OpenAI(base_url=f"{keyed_router.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi")
    assert httpx.get(f"{keyed_router.url}/health").status_code == 200
    assert httpx.get(f"{keyed_router.url}/metrics").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_overloaded_is_429_with_retry_after(router, backend, stream):
    backend.error = Overloaded("prefill queues are full", retry_after_s=2.2)
    resp = httpx.post(f"{router.url}/v1/completions", json={**BODY, "stream": stream})
    assert resp.status_code == 429
    assert resp.headers["Retry-After"] == "3"
    assert "prefill queues are full" in resp.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_no_replica_is_503(router, backend, stream):
    backend.error = NoReplica("no decode replica is ready")
    resp = httpx.post(
        f"{router.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": stream},
    )
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "no decode replica is ready"


def test_rejected_is_400(router, backend):
    backend.error = RequestRejected("needs 9000 tokens of KV cache; the largest holds 4096")
    resp = httpx.post(f"{router.url}/v1/completions", json=BODY)
    assert resp.status_code == 400
    assert "KV cache" in resp.json()["error"]["message"]


def test_openai_client_sees_the_statuses(router, backend):
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    backend.error = Overloaded(retry_after_s=1)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="tiny", prompt="hi")
    backend.error = NoReplica("none")
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="tiny", prompt="hi", stream=True)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=-3)


def test_health_degraded_is_503(router, backend):
    async def degraded():
        return {"status": "degraded", "prefill": 0, "decode": 1}

    backend.health = degraded
    try:
        resp = httpx.get(f"{router.url}/health")
    finally:
        del backend.health
    assert resp.status_code == 503 and resp.json()["prefill"] == 0
