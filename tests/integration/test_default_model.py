"""The real default model served as a user serves it (smollm2-135m, one prefill and one decode
actor): chat through the official openai client, streamed and not, and over gRPC."""

from __future__ import annotations

import pytest

from cluster.launcher import stop_cluster
from tests.integration.conftest import start

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(ray_session, default_model_file):
    running = start({"model": "smollm2-135m", "engine": {"num_kv_blocks": 128}})
    yield running
    stop_cluster(running)


def client_of(cluster):
    import openai

    return openai.OpenAI(base_url=cluster.urls["http"] + "/v1", api_key="unused", max_retries=0)


def test_the_default_model_answers_a_chat_question(served):
    client = client_of(served)
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    reply = client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, max_tokens=32, temperature=0
    )
    text = reply.choices[0].message.content
    assert "Paris" in text and reply.choices[0].finish_reason == "stop", text
    chunks = client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, max_tokens=32, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_grpc_chat_gives_the_same_reply(served):
    from router.client import RouterClient

    with RouterClient(served.urls["grpc"]) as client:
        result = client.generate(QUESTION, max_tokens=32, temperature=0)
    assert "Paris" in result["text"] and result["finish_reason"] == "stop"
