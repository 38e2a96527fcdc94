"""The gRPC API and RouterClient against the live router."""

from __future__ import annotations

import argparse

import pytest

from router import NoReplica, Overloaded, RouterConfig
from router.client import RouterClient, RouterError, add_submit_parser
from tests.router.conftest import LiveRouter
from tests.router.fake_backend import DEFAULT_TEXT, FakeBackend


@pytest.fixture
def client(router):
    with RouterClient(f"127.0.0.1:{router.grpc_port}", timeout_s=10) as c:
        yield c


def test_generate_round_trip(client, backend):
    out = client.generate("Hi", max_tokens=20, temperature=0, seed=7)
    assert out["text"] == DEFAULT_TEXT.encode()[:20].decode()
    assert out["token_ids"] == list(DEFAULT_TEXT.encode()[:20])
    assert out["finish_reason"] == "length"
    assert out["prompt_token_ids"] == [256, ord("H"), ord("i")]
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 20, "total_tokens": 23}
    params = backend.calls[0].params
    assert (params.max_tokens, params.temperature, params.seed) == (20, 0.0, 7)


def test_defaults_match_http(client, backend):
    out = client.generate([1, 2, 3])
    assert len(out["token_ids"]) == 16 and backend.calls[0].params.temperature == 1.0


def test_stream_with_stop_and_logprobs(client):
    chunks = list(client.stream("Hi", stop=["fox"], logprobs=2, max_tokens=100))
    assert "".join(c["text"] for c in chunks) == DEFAULT_TEXT[: DEFAULT_TEXT.index("fox")]
    assert chunks[-1]["finish_reason"] == "stop"
    assert all(c["finish_reason"] is None for c in chunks[:-1])
    assert len(chunks[0]["logprobs"][0]["top"]) == 3


def test_errors(client, backend):
    with pytest.raises(RouterError) as err:
        client.generate("Hi", max_tokens=-1)
    assert err.value.code == "INVALID_ARGUMENT" and "max_tokens" in err.value.message
    with pytest.raises(RouterError) as err:
        client.generate([999])
    assert err.value.code == "INVALID_ARGUMENT" and "vocabulary" in err.value.message
    with pytest.raises(RouterError) as err:
        client.generate("Hi", model="other")
    assert err.value.code == "NOT_FOUND"
    assert backend.calls == []
    backend.error = Overloaded(retry_after_s=4)
    with pytest.raises(RouterError) as err:
        client.generate("Hi")
    assert err.value.code == "RESOURCE_EXHAUSTED" and err.value.retry_after_s == 4
    backend.error = NoReplica("no decode replica")
    with pytest.raises(RouterError) as err:
        client.generate("Hi")
    assert err.value.code == "UNAVAILABLE"


def test_leaving_the_stream_cancels(client, backend):
    backend.delay_s = 0.05
    stream = client.stream("Hi", max_tokens=200)
    next(stream)
    stream.close()
    assert backend.cancel_seen.wait(5)
    assert len(backend.cancelled) == 1


def test_health(client):
    assert client.health()["status"] == "ok"


def test_api_key():
    with LiveRouter(FakeBackend(), RouterConfig(api_key="k")) as router:
        address = f"127.0.0.1:{router.grpc_port}"
        with pytest.raises(RouterError) as err:
            RouterClient(address).generate("Hi")
        assert err.value.code == "UNAUTHENTICATED"
        assert RouterClient(address, api_key="k").generate("Hi", max_tokens=2)["text"] == "He"


def test_submit_command(router, capsys):
    parser = argparse.ArgumentParser()
    add_submit_parser(parser.add_subparsers())
    address = f"127.0.0.1:{router.grpc_port}"
    args = parser.parse_args(["submit", "Hi", "--address", address, "--max-tokens", "5"])
    assert args.func(args) == 0
    assert capsys.readouterr().out == "Hello\n"
    args = parser.parse_args(["submit", "Hi", "--address", address, "--stream", "--json"])
    assert args.func(args) == 0
    assert '"finish_reason": "length"' in capsys.readouterr().out
    args = parser.parse_args(["submit", "Hi", "--address", "127.0.0.1:1", "--timeout", "2"])
    assert args.func(args) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
