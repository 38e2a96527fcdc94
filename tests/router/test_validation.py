"""Bad requests: each answered with a clear OpenAI-style error, and never sent to the backend."""

from __future__ import annotations

import httpx
import pytest

BIG = 10**30
LONG = list(range(10)) * 30  # 300 tokens > max_model_len 256

COMPLETION_CASES = [
    # (body, status, param, words in the message)
    ({"max_tokens": 4}, 400, "prompt", "prompt is required"),
    ({"prompt": ""}, 400, "prompt", "empty"),
    ({"prompt": []}, 400, "prompt", "empty"),
    ({"prompt": 5}, 400, "prompt", "string or a list of token ids"),
    ({"prompt": ["a"] * 65}, 400, "prompt", "at most 64 prompts"),
    ({"prompt": ["a", 5]}, 400, "prompt", "prompt[1] must be a string"),
    ({"prompt": ["a", ""]}, 400, "prompt[1]", "empty"),
    ({"prompt": [1, "a"]}, 400, "prompt", "list of token ids"),
    ({"prompt": [1, True]}, 400, "prompt", "list of token ids"),
    ({"prompt": [1, 320]}, 400, "prompt", "outside the vocabulary"),
    ({"prompt": [-1]}, 400, "prompt", "outside the vocabulary"),
    ({"prompt": LONG}, 400, "prompt", "maximum context length"),
    ({"prompt": [1] * 256}, 400, "prompt", "maximum context length"),
    ({"prompt": "x" * 300}, 400, "prompt", "maximum context length"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "positive"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "positive"),
    ({"prompt": "hi", "max_tokens": "16"}, 400, "max_tokens", "valid integer"),
    ({"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens", "valid integer"),
    ({"prompt": "hi", "max_tokens": BIG}, 400, "max_tokens", "at most"),
    ({"prompt": "hi", "temperature": -0.1}, 400, "temperature", "temperature"),
    ({"prompt": "hi", "temperature": 1000}, 400, "temperature", "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature", "valid number"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p", "top_p"),
    ({"prompt": "hi", "top_k": -5}, 400, "top_k", "top_k"),
    ({"prompt": "hi", "seed": -1}, 400, "seed", "seed"),
    ({"prompt": "hi", "seed": BIG}, 400, "seed", "seed"),
    ({"prompt": "hi", "stop": 5}, 400, "stop", "a string or a list of strings"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop", "non-empty"),
    ({"prompt": "hi", "stop": ["s"] * 17}, 400, "stop", "at most 16"),
    ({"prompt": "hi", "stop_token_ids": [400]}, 400, "stop_token_ids", "vocabulary"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs", "at most 20"),
    ({"prompt": "hi", "logprobs": True}, 400, "logprobs", "valid integer"),
    ({"prompt": "hi", "n": 17}, 400, "n", "n must be in [1, 16]"),
    ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty", "[-2, 2]"),
    ({"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty", "[-2, 2]"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", "(0, 2]"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias", "not a token id"),
    ({"prompt": "hi", "logit_bias": {"400": 1}}, 400, "logit_bias", "vocabulary"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    ({"prompt": "hi", "logit_bias": [5]}, 400, "logit_bias", "valid dictionary"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream", "valid boolean"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ({"prompt": "hi", "min_tokens": 99, "max_tokens": 2}, 400, "min_tokens", "min_tokens"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "does not exist"),
]

CHAT_CASES = [
    ({}, 400, "messages", "non-empty list"),
    ({"messages": []}, 400, "messages", "non-empty list"),
    ({"messages": "hi"}, 400, "messages", "non-empty list"),
    ({"messages": [{"content": "hi"}]}, 400, "messages", "role"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages", "content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages",
        "text parts",
    ),
    ({"messages": [{"role": "user", "content": "x" * 300}]}, 400, "messages", "context length"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
        "logprobs",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "positive",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n", "n must be in"),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}},
        },
        400,
        "response_format",
        'json_schema cannot be compiled: Unsupported type "x"',
    ),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema"},
        },
        400,
        "response_format",
        "must be an object with a schema",
    ),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "guided_regex": "(a",
            "guided_choice": ["a"],
        },
        400,
        "structured_outputs",
        "one output format at most",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"regex": "(a"}},
        400,
        "structured_outputs",
        "regex cannot be compiled",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"xml": "a"}},
        400,
        "structured_outputs",
        "structured_outputs.xml is not supported",
    ),
]


def _check(resp: httpx.Response, status: int, param: str | None, words: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert words.lower() in error["message"].lower(), error
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,status,param,words", COMPLETION_CASES)
def test_bad_completion(router, backend, body, status, param, words):
    _check(httpx.post(f"{router.url}/v1/completions", json=body), status, param, words)
    assert backend.calls == []


@pytest.mark.parametrize("body,status,param,words", CHAT_CASES)
def test_bad_chat(router, backend, body, status, param, words):
    _check(httpx.post(f"{router.url}/v1/chat/completions", json=body), status, param, words)
    assert backend.calls == []


@pytest.mark.parametrize(
    "content,words",
    [
        (b'{"prompt": "hi"', "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"prompt": NaN}', "not a number"),
        (b'{"prompt": "\xff\xfe"}', "UTF-8"),
        (b'{"prompt": "\\ud800"}', "surrogate"),
        (b"", "not valid JSON"),
        (b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}", "nested too deeply"),
    ],
)
def test_malformed_body(router, backend, content, words):
    resp = httpx.post(
        f"{router.url}/v1/completions",
        content=content,
        headers={"content-type": "application/json"},
    )
    _check(resp, 400, None, words)
    assert backend.calls == []


def test_oversize_body(router, backend):
    body = {"prompt": "hi", "junk": "x" * (router.config.max_body_bytes + 1)}
    resp = httpx.post(f"{router.url}/v1/completions", json=body)
    _check(resp, 413, None, "larger than")
    assert backend.calls == []


def test_unknown_route_has_openai_error_body(router):
    resp = httpx.get(f"{router.url}/v1/nothing")
    assert resp.status_code == 404 and "message" in resp.json()["error"]


def test_lenient_where_openai_is(router, backend):
    """Unknown fields are ignored; prompt as a one-element list; top_k -1 means off."""
    body = {"prompt": [[1, 2]], "top_k": -1, "user": "u", "whatever": 1, "temperature": 0}
    resp = httpx.post(f"{router.url}/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert backend.calls[0].prompt_token_ids == [1, 2]
    assert backend.calls[0].params.top_k == 0


def test_max_tokens_capped_by_context(router, backend):
    prompt = [1] * 250
    resp = httpx.post(f"{router.url}/v1/completions", json={"prompt": prompt, "max_tokens": 100})
    assert resp.status_code == 200
    assert backend.calls[0].params.max_tokens == 6
