"""Every official field of /v1/completions and /v1/chat/completions is served, or refused
with a 400 naming it: none is silently dropped. The field lists are OpenAI's API reference
(2026); the test fails when a field is in neither table."""

from __future__ import annotations

import httpx
import pytest

COMPLETION_FIELDS = (
    "model prompt best_of echo frequency_penalty logit_bias logprobs max_tokens n "
    "presence_penalty seed stop stream stream_options suffix temperature top_p user"
).split()

CHAT_FIELDS = (
    "messages model audio frequency_penalty function_call functions logit_bias logprobs "
    "max_completion_tokens max_tokens metadata modalities n parallel_tool_calls prediction "
    "presence_penalty prompt_cache_key reasoning_effort response_format safety_identifier "
    "seed service_tier stop store stream stream_options temperature tool_choice tools "
    "top_logprobs top_p user verbosity web_search_options"
).split()

# Served: a value the server honours (200).
SERVED_COMPLETION = {
    "model": "tiny",
    "prompt": "hi",
    "best_of": 1,
    "echo": True,
    "frequency_penalty": 0.5,
    "logit_bias": {"5": 1.0},
    "logprobs": 2,
    "max_tokens": 3,
    "n": 1,
    "presence_penalty": -0.5,
    "seed": 3,
    "stop": ["zz"],
    "stream": False,
    "suffix": "",
    "temperature": 0.7,
    "top_p": 0.9,
    "user": "someone",
}
SERVED_CHAT = {
    "messages": [{"role": "user", "content": "hi"}],
    "model": "tiny",
    "frequency_penalty": 0.5,
    "function_call": "none",
    "functions": [],
    "logit_bias": {"5": -1.0},
    "logprobs": True,
    "max_completion_tokens": 3,
    "max_tokens": 3,
    "modalities": ["text"],
    "n": 1,
    "presence_penalty": 0.5,
    "prompt_cache_key": "k",
    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
    "safety_identifier": "s",
    "seed": 1,
    "service_tier": "auto",
    "stop": "zz",
    "store": False,
    "stream": False,
    "temperature": 0.0,
    "tool_choice": "none",
    "tools": [],
    "parallel_tool_calls": True,
    "top_logprobs": 2,
    "top_p": 0.5,
    "user": "someone",
}
STREAM_OPTIONS = {"stream": True, "stream_options": {"include_usage": True}}

# Not served (or not with this value): the 400 names the field.
REFUSED_COMPLETION = {"best_of": 2, "n": 17, "suffix": " and so on"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
REFUSED_CHAT = {
    "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto",
    "functions": [TOOL["function"]],
    "metadata": {"k": "v"},
    "modalities": ["text", "audio"],
    "n": 0,
    "parallel_tool_calls": "yes",
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "response_format": {"type": "yaml"},
    "service_tier": "flex",
    "store": True,
    "tool_choice": "sometimes",
    "tools": [{"type": "function"}],
    "verbosity": "low",
    "web_search_options": {},
}


def test_every_official_field_is_in_a_table():
    for fields, served, refused in (
        (COMPLETION_FIELDS, SERVED_COMPLETION, REFUSED_COMPLETION),
        (CHAT_FIELDS, SERVED_CHAT, REFUSED_CHAT),
    ):
        missing = set(fields) - set(served) - set(refused) - {"stream_options"}
        assert not missing, f"fields in neither table: {sorted(missing)}"


COMPLETION_BASE = {"prompt": "hi", "max_tokens": 3}
CHAT_BASE = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
NEEDS = {"top_logprobs": {"logprobs": True}}


@pytest.mark.parametrize(
    "path,base,field,value",
    [("completions", COMPLETION_BASE, f, v) for f, v in SERVED_COMPLETION.items()]
    + [("chat/completions", CHAT_BASE, f, v) for f, v in SERVED_CHAT.items()],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_served_field_is_served(router, path, base, field, value, stream):
    body = {**base, **NEEDS.get(field, {}), field: value, **(STREAM_OPTIONS if stream else {})}
    resp = httpx.post(f"{router.url}/v1/{path}", json=body, timeout=30)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    "path,base,field,value",
    [("completions", {"prompt": "hi"}, f, v) for f, v in REFUSED_COMPLETION.items()]
    + [
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, f, v)
        for f, v in REFUSED_CHAT.items()
    ],
)
def test_an_unserved_field_is_a_400_naming_it(router, backend, path, base, field, value):
    resp = httpx.post(f"{router.url}/v1/{path}", json={**base, field: value}, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and field in error["message"], error
    assert backend.calls == []


def test_an_extra_that_is_not_openais_is_ignored(router):
    resp = httpx.post(
        f"{router.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "nonsense": 1}
    )
    assert resp.status_code == 200, resp.text
