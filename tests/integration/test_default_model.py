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


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_json_schema_output_validates_in_10_of_10_seeded_samples(served):
    """The first token is masked on the prefill worker, the rest on decode: one grammar.
    One at a time: this is the served default, whose SLO admission may refuse a burst."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    client = client_of(served)
    ask = [{"role": "user", "content": "Give me a person as JSON with a name and an age."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def sample(seed: int):
        return client.chat.completions.create(
            model="smollm2-135m",
            messages=ask,
            max_tokens=48,
            temperature=0.8,
            seed=seed,
            response_format=response_format,
        ).choices[0]

    for choice in map(sample, range(10)):
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_a_required_tool_call_comes_back_parsed_and_valid(served):
    import json

    jsonschema = pytest.importorskip("jsonschema")
    client = client_of(served)
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    options = dict(
        model="smollm2-135m",
        messages=ask,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=48,
        temperature=0,
    )
    choice = client.chat.completions.create(**options).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    streamed = list(client.chat.completions.create(**options, stream=True))
    pieces = [c for chunk in streamed for c in (chunk.choices[0].delta.tool_calls or [])]
    assert [p.function.name for p in pieces if p.id] == [call.function.name]
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
