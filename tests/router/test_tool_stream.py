"""Tool calls streamed as OpenAI streams them: the reader (ToolCallStream) fed an answer in
any pieces agrees with the whole answer's parse, and the router's chat stream over the fake
backend sends content early and calls piece by piece."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai
import pytest

from engine.sampling_params import SamplingParams
from router import RouterConfig
from router.backend import GenerateRequest
from router.generation import TextDelta
from router.metrics import RouterMetrics
from router.openai_api import OpenAIServer
from router.openai_format import Prepared
from router.tool_call_stream import ToolCallStream, tool_answer
from router.tool_calls import tool_use
from tests.router.conftest import LiveRouter
from tests.router.fake_backend import FakeBackend

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USE = tool_use([WEATHER, TIME], None)

PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
ANSWERS = {
    "tagged": f"<tool_call>\n{PARIS}\n</tool_call>",
    "plain json": PARIS,
    "list of two": f'[{PARIS}, {{"name": "get_time", "parameters": {{}}}}]',
    "text then two tagged": f"Let me look.\n<tool_call>{PARIS}</tool_call>\n"
    '<tool_call>{"arguments": "{\\"tz\\": \\"CET\\"}", "name": "get_time"}</tool_call>',
    "escapes and numbers": '{"name": "get_weather", "arguments": {"city": "S\\u00e3o \\"P\\"\\n'
    '\\ud83d\\ude00 \\ud800x", "days": 1E1, "x": [-0, 0.50, true, null, {}], "y": []}}',
    "malformed": '{"name": get_weather, "arguments": {}}',
    "malformed after the name": '{"name": "get_weather", "arguments": {"city": Paris}}',
    "unknown tool": '{"name": "launch_rockets", "arguments": {}}',
    "not a call": '{"city": "Paris"}',
    "cut off": '{"name": "get_weather", "arguments": {"city": "Par',
    "plain text": "  It is sunny in <b>Paris</b> <tool_call",
}


def streamed(text: str, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Feed ``pieces``; the content and (name, arguments) of each call, checking the deltas'
    shape on the way: a call's first delta (its id, name, arguments "") before its argument
    pieces, indexes 0, 1, ..., one id each."""
    assert "".join(pieces) == text
    stream = ToolCallStream(USE)
    parts = [p for piece in pieces for p in stream.feed(piece)] + stream.finish()
    content, calls, ids = "", [], set()
    for part in parts:
        assert len(part) == 1, part
        content += part.get("content", "")
        for call in part.get("tool_calls", ()):
            if "id" in call:
                assert call["index"] == len(calls) and call["type"] == "function"
                assert call["id"].startswith("call_") and call["id"] not in ids
                assert call["function"]["arguments"] == ""
                ids.add(call["id"])
                calls.append([call["function"]["name"], ""])
            else:
                assert set(call) == {"index", "function"} and call["index"] == len(calls) - 1
                calls[-1][1] += call["function"]["arguments"]
    assert stream.num_calls == len(calls)
    return (content or None) if calls else content, [tuple(c) for c in calls]


def whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = tool_answer(text, USE)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls or []]


def random_pieces(text: str, rng: random.Random) -> list[str]:
    pieces, at = [], 0
    while at < len(text):
        size = rng.randint(1, 9)
        pieces.append(text[at : at + size])
        at += size
    return pieces


@pytest.mark.parametrize("name", ANSWERS)
def test_any_split_of_an_answer_streams_what_the_whole_answer_says(name):
    text = ANSWERS[name]
    expected = whole(text)
    assert streamed(text, list(text)) == expected  # a character at a time
    rng = random.Random(name)
    for _ in range(20):
        assert streamed(text, random_pieces(text, rng)) == expected
    for cut in range(len(text) + 1):  # every split point
        assert streamed(text, [text[:cut], text[cut:]]) == expected


def test_calls_have_the_arguments_json_dumps_gives():
    dumps = json.dumps
    assert whole(ANSWERS["tagged"]) == (
        None,
        [("get_weather", dumps({"city": "Paris", "days": 3}))],
    )
    assert whole(ANSWERS["list of two"]) == (
        None,
        [("get_weather", dumps({"city": "Paris", "days": 3})), ("get_time", "{}")],
    )
    assert whole(ANSWERS["text then two tagged"]) == (
        "Let me look.\n",
        [("get_weather", dumps({"city": "Paris", "days": 3})), ("get_time", '{"tz": "CET"}')],
    )
    raw = ANSWERS["escapes and numbers"]
    arguments = json.loads(raw)["arguments"]
    assert whole(raw) == (None, [("get_weather", dumps(arguments, ensure_ascii=False))])


@pytest.mark.parametrize("name", ["malformed", "unknown tool", "not a call", "plain text"])
def test_what_is_not_a_call_is_all_content(name):
    assert whole(ANSWERS[name]) == (ANSWERS[name], [])


def test_a_call_broken_after_its_name_keeps_what_was_sent_and_the_rest_is_content():
    # The name went out, so the call stays; the arguments are the part that was certain.
    assert whole(ANSWERS["malformed after the name"]) == (
        "Paris}}",
        [("get_weather", '{"city": ')],
    )
    assert whole(ANSWERS["cut off"]) == (None, [("get_weather", '{"city": "Par')])
    assert whole('{"name": "get_weather", "arguments": {"days": 12') == (
        "12",  # a number is not certain until what follows it
        [("get_weather", '{"days": ')],
    )


def test_text_is_held_back_only_while_it_may_be_a_call():
    stream = ToolCallStream(USE)
    assert stream.feed("Hel") == [{"content": "Hel"}]  # cannot be a call: sent at once
    assert stream.feed("lo <tool") == [{"content": "lo "}]  # "<tool" may open a call
    assert stream.feed("s>") == [{"content": "<tools>"}]
    for start in ("  {", "\n[", "<tool_c", " <tool_call> "):
        stream = ToolCallStream(USE)
        assert stream.feed(start) == []
        assert stream.finish() == [{"content": start}]  # nothing lost


def test_a_key_twice_in_the_arguments_ends_the_call_there():
    # json.loads would keep the second value at the first key's place, after it was sent.
    text = '{"name": "get_weather", "arguments": {"city": "A", "city": "B"}}'
    assert whole(text) == ('"city": "B"}}', [("get_weather", '{"city": "A", ')])


# ---- random arguments, written in the many ways JSON allows ----------------------------
ALPHABET = ["a", "Z", " ", "é", "中", "😀", '"', "\\", "/", "\n", "\t", "\x01", "\x7f", "<", "}"]
ALPHABET += [",", ":", "\u2028", "\ud83d", "\ude00"]  # lone surrogates, as json.loads keeps them


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["dict", "list", "str", "int", "float", "lit"] if depth < 3 else ["str"])
    if kind == "dict":
        return {random_string(rng): random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "str":
        return random_string(rng)
    if kind == "int":
        return rng.randint(-(10**20), 10**20)
    if kind == "float":
        return rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30)
    return rng.choice([True, False, None])


def random_string(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))


def write(value, rng: random.Random) -> str:
    """``value`` as JSON text, with random whitespace, escapes and number forms."""

    def ws() -> str:
        return rng.choice(["", "", " ", "\n  ", "\t", "\r\n"])

    if isinstance(value, dict):
        items = [
            f"{ws()}{write_string(k, rng)}{ws()}:{ws()}{write(v, rng)}{ws()}"
            for k, v in value.items()
        ]
        return "{" + (",".join(items) or ws()) + "}"
    if isinstance(value, list):
        return "[" + (",".join(ws() + write(v, rng) + ws() for v in value) or ws()) + "]"
    if isinstance(value, str):
        return write_string(value, rng)
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return rng.choice([str(value), f"{value}e0", f"{value}.0", f"{value}E+00"])
    return rng.choice([repr(value), f"{value:e}", f"{value:E}", f"{value:.3f}"])


def write_string(text: str, rng: random.Random) -> str:
    out = []
    for ch in text:
        code = ord(ch)
        escaped = json.dumps(ch)[1:-1]  # \uXXXX (surrogate pairs above the BMP) or \n, \"...
        hexed = "".join(f"\\u{u:04{rng.choice('xX')}}" for u in _utf16(code))
        if ch in '"\\' or code < 0x20:
            out.append(rng.choice([escaped, hexed]))
        else:
            out.append(rng.choice([ch, ch, escaped, hexed, "\\/" if ch == "/" else ch]))
    return '"' + "".join(out) + '"'


def _utf16(code: int) -> list[int]:
    if code < 0x10000:
        return [code]
    code -= 0x10000
    return [0xD800 + (code >> 10), 0xDC00 + (code & 0x3FF)]


def test_random_arguments_stream_as_json_dumps_renders_them():
    rng = random.Random(1234)
    for i in range(300):
        arguments = {random_string(rng): random_value(rng) for _ in range(rng.randint(0, 4))}
        raw = write(arguments, rng)
        expected = json.dumps(json.loads(raw), ensure_ascii=False)
        call = rng.choice(
            [
                '{"name": "get_weather", "arguments": ARGS}',
                '<tool_call>{"parameters":ARGS,"name":"get_weather"}</tool_call>',
                '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": ARGS}]',
            ]
        )
        if i % 5 == 0:  # the arguments as a string holding the object
            call, raw_in = '{"name": "get_weather", "arguments": ARGS}', json.dumps(raw)
        else:
            raw_in = raw
        text = call.replace("ARGS", raw_in)
        pieces = list(text) if i % 2 else random_pieces(text, rng)
        content, calls = streamed(text, pieces)
        assert content is None and calls[-1] == ("get_weather", expected), raw
        assert (content, calls) == whole(text)


# ---- the router's stream, over the fake backend -----------------------------------------
@pytest.fixture(scope="module")
def tool_router():
    # A context long enough for the system message that describes the tools.
    with LiveRouter(FakeBackend(max_model_len=2048), RouterConfig()) as router:
        yield router


@pytest.fixture
def fake(tool_router) -> FakeBackend:
    tool_router.backend.reset()
    return tool_router.backend


def ask(**extra) -> dict:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER, TIME],
        "stop": "#",  # the fake backend repeats its text: "#" ends the answer with "stop"
    }
    return {**body, **extra}


def events(router: LiveRouter, body: dict) -> list[dict]:
    with httpx.stream(
        "POST", f"{router.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30
    ) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_text_answer_streams_its_content_as_it_comes(tool_router, fake):
    chunks = events(tool_router, ask(max_tokens=20, stop=None))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": "Hel"}  # the first delta, at once
    contents = [d["content"] for d in deltas if d.get("content")]
    assert len(contents) > 3 and "".join(contents) == fake.text.encode()[:20].decode()
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * len(contents) + ["length"]
    assert deltas[-1] == {}


@pytest.mark.parametrize("tokens_per_delta", [1, 4])
def test_a_tagged_call_streams_its_arguments_in_pieces(tool_router, fake, tokens_per_delta):
    fake.text = ANSWERS["tagged"] + "#"
    fake.tokens_per_delta = tokens_per_delta
    whole_reply = httpx.post(f"{tool_router.url}/v1/chat/completions", json=ask(), timeout=30)
    (call,) = whole_reply.json()["choices"][0]["message"]["tool_calls"]
    chunks = events(tool_router, ask(stream_options={"include_usage": True}))
    pieces = [
        p for c in chunks if c["choices"] for p in c["choices"][0]["delta"].get("tool_calls", [])
    ]
    first, rest = pieces[0], pieces[1:]
    assert first["id"].startswith("call_") and first["function"] == {
        "name": "get_weather",
        "arguments": "",
    }
    assert len(rest) > 1 and all(set(p) == {"index", "function"} for p in rest)
    assert "".join(p["function"]["arguments"] for p in rest) == call["function"]["arguments"]
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(
        fake.text.encode()
    )


def test_the_openai_client_accumulates_two_listed_calls(tool_router, fake):
    fake.text = ANSWERS["list of two"] + "#"
    client = openai.OpenAI(base_url=f"{tool_router.url}/v1", api_key="unused", max_retries=0)
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in (WEATHER, TIME)]
    with client.chat.completions.stream(**{**ask(), "tools": strict}) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris", "days": 3}, {}]
    assert calls[0].function.parsed_arguments == {"city": "Paris", "days": 3}
    assert len({c.id for c in calls}) == 2


def test_malformed_json_streams_as_content_and_logprobs_ride_along(tool_router, fake):
    fake.text = ANSWERS["malformed"] + "#"
    chunks = events(tool_router, ask(logprobs=True))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == ANSWERS["malformed"]
    assert not any("tool_calls" in d for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    tokens = [t["token"] for c in chunks for t in c["choices"][0]["logprobs"]["content"]]
    assert "".join(tokens) == ANSWERS["malformed"] + "#"  # every token's once, in order


def test_each_choice_streams_in_turn_with_its_own_reader():
    backend = FakeBackend()
    server = OpenAIServer(backend, RouterConfig(), RouterMetrics.of(backend))
    request = GenerateRequest("r", [1], SamplingParams(max_tokens=64), 0.0)
    prep = Prepared(
        kind="chat",
        request_id="chatcmpl-t",
        requests=[request, request],
        model="tiny",
        stream=True,
        include_usage=False,
        return_token_ids=False,
        logprobs=False,
        tools=USE,
    )
    answers = [ANSWERS["tagged"], "Hello"]

    async def choice(text: str):
        for i in range(0, len(text), 5):
            last = i + 5 >= len(text)
            yield TextDelta(text[i : i + 5], [0] * 5, finish_reason="stop" if last else None)

    async def run() -> list[dict]:
        streams = [choice(t) for t in answers]
        firsts = [await s.__anext__() for s in streams]
        return [
            json.loads(e[6:])
            for e in [e async for e in server._events(prep, firsts, streams)]
            if e != "data: [DONE]\n\n"
        ]

    chunks = asyncio.run(run())
    indexes = [c["choices"][0]["index"] for c in chunks]
    assert indexes == sorted(indexes) and set(indexes) == {0, 1}
    by_choice = [[c["choices"][0] for c in chunks if c["choices"][0]["index"] == i] for i in (0, 1)]
    assert [c["finish_reason"] for c in by_choice[0]][-1] == "tool_calls"
    assert by_choice[0][0]["delta"]["role"] == "assistant"
    assert by_choice[0][0]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert [c["delta"] for c in by_choice[1]] == [
        {"role": "assistant", "content": "Hello"},
        {},
    ] and by_choice[1][-1]["finish_reason"] == "stop"
