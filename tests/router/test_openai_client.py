"""The official openai client against a live router over the fake backend."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.router.fake_backend import DEFAULT_TEXT


@pytest.fixture
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_completion(client, backend):
    out = client.completions.create(model="tiny", prompt="Hi", max_tokens=20, temperature=0)
    choice = out.choices[0]
    assert choice.text == DEFAULT_TEXT.encode()[:20].decode()
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == 3  # <bos> H i
    assert out.usage.completion_tokens == 20
    assert out.usage.total_tokens == 23
    (request,) = backend.calls
    assert request.prompt_token_ids == [256, ord("H"), ord("i")]
    assert request.params.max_tokens == 20 and request.params.temperature == 0


def test_completion_default_max_tokens_is_16(client, backend):
    out = client.completions.create(model="tiny", prompt=[1, 2, 3])
    assert out.usage.completion_tokens == 16
    assert backend.calls[0].prompt_token_ids == [1, 2, 3]


def test_completion_stream(client, backend):
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="Hi",
            max_tokens=30,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == DEFAULT_TEXT.encode()[:30].decode()
    assert all("\ufffd" not in c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == 30
    assert backend.finished and not backend.cancelled


def test_chat(client, backend):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == "Hello"
    expected = list(b"<|user|>\nHi\n<|assistant|>\n")  # template, no BOS added
    assert backend.calls[0].prompt_token_ids == expected


def test_chat_default_max_tokens_fills_the_context(client, backend):
    backend.text = "abc"
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    request = backend.calls[0]
    assert request.params.max_tokens == backend.max_model_len - len(request.prompt_token_ids)


def test_chat_stream_stop_string(client, backend):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "Hi"}],
        stop=["fox"],
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == DEFAULT_TEXT[: DEFAULT_TEXT.index("fox")]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == ["H", "e", "l"]
    assert all(len(c.top_logprobs) == 3 for c in content)  # chosen + 2


def test_completion_logprobs(client):
    out = client.completions.create(model="tiny", prompt="Hi", max_tokens=4, logprobs=1)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["H", "e", "l", "l"] and lp.text_offset == [0, 1, 2, 3]
    assert lp.token_logprobs == [-0.5] * 4


def test_return_token_ids(client, router):
    out = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=5, extra_body={"return_token_ids": True}
    )
    body = out.model_dump()
    assert body["prompt_token_ids"] == [256, ord("H"), ord("i")]
    assert body["choices"][0]["token_ids"] == list(b"Hello")
    # streaming: each chunk's choice carries its new tokens; the first the prompt's
    with httpx.stream(
        "POST",
        f"{router.url}/v1/completions",
        json={"prompt": "Hi", "max_tokens": 7, "stream": True, "return_token_ids": True},
    ) as resp:
        chunks = [line for line in resp.iter_lines() if line.startswith("data: {")]
    import json

    chunks = [json.loads(c[6:]) for c in chunks]
    assert chunks[0]["prompt_token_ids"] == [256, ord("H"), ord("i")]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == list(b"Hello, ")


def test_models(client):
    (model,) = client.models.list().data
    assert model.id == "tiny"


def test_sse_ends_with_done(router):
    with httpx.stream(
        "POST", f"{router.url}/v1/completions", json={"prompt": "Hi", "stream": True}
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_error_mid_stream_is_an_error_event(router, backend):
    backend.fail_after_first = True
    with httpx.stream(
        "POST", f"{router.url}/v1/completions", json={"prompt": "Hi", "stream": True}
    ) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert '"error"' in lines[-2] and "decode-0 died" in lines[-2]
    assert lines[-1] == "data: [DONE]"
    resp = httpx.post(f"{router.url}/v1/completions", json={"prompt": "Hi"})
    assert resp.status_code == 500 and "decode-0 died" in resp.json()["error"]["message"]


def test_health(router):
    resp = httpx.get(f"{router.url}/health")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"
