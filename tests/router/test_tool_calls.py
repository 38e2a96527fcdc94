"""Tools in chat: validation, the forced-call grammar, parsing a model's calls."""

from __future__ import annotations

import json

import pytest

from engine.structured_output import GrammarCompiler
from engine.tokenizer import ByteTokenizer
from router.errors import APIError
from router.tool_call_stream import parse_tool_calls
from router.tool_calls import describe_tools, tool_grammar, tool_use

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tool_use_reads_the_choice():
    assert tool_use(None, None) is None and tool_use([WEATHER], "none") is None
    assert tool_use([WEATHER], None).choice == "auto"
    assert tool_use([WEATHER, TIME], "required").forced
    named = tool_use([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.choice == "get_time" and named.tools[1].parameters["type"] == "object"


@pytest.mark.parametrize(
    "tools,choice,param,words",
    [
        (None, "required", "tool_choice", "needs tools"),
        ("f", None, "tools", "a list"),
        ([{"type": "function"}], None, "tools", "tools[0]"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools", "letters"),
        ([WEATHER, WEATHER], None, "tools", "same name"),
        ([WEATHER], {"type": "function", "function": {"name": "x"}}, "tool_choice", "not in"),
        ([WEATHER], "sometimes", "tool_choice", "must be"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(tools, choice, param, words):
    with pytest.raises(APIError) as err:
        tool_use(tools, choice)
    assert err.value.status == 400 and err.value.param == param and words in str(err.value)


def test_calls_are_parsed_in_the_forms_models_write_them():
    use = tool_use([WEATHER, TIME], None)
    tagged = parse_tool_calls(
        'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        use,
    )
    assert [c["function"]["name"] for c in tagged] == ["get_weather", "get_time"]
    assert json.loads(tagged[0]["function"]["arguments"]) == {"city": "Paris"}
    assert tagged[0]["type"] == "function" and tagged[0]["id"].startswith("call_")
    plain = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Rome"}}', use)
    assert json.loads(plain[0]["function"]["arguments"]) == {"city": "Rome"}
    as_string = parse_tool_calls('[{"name": "get_time", "arguments": "{}"}]', use)
    assert as_string[0]["function"]["arguments"] == "{}"
    assert parse_tool_calls("It is sunny in Paris.", use) is None
    assert parse_tool_calls('{"name": "launch_rockets", "arguments": {}}', use) is None


def test_the_forced_call_grammar_compiles_and_names_only_the_offered_tools():
    compiler = pytest.importorskip("xgrammar") and GrammarCompiler(ByteTokenizer(), 320)
    required = tool_grammar(tool_use([WEATHER, TIME], "required"))
    schema = json.loads(required.source)
    assert [c["properties"]["name"]["const"] for c in schema["anyOf"]] == [
        "get_weather",
        "get_time",
    ]
    compiler.compile(required)
    named = tool_grammar(
        tool_use([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    )
    assert json.loads(named.source)["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert tool_grammar(tool_use([WEATHER], "auto")) is None


def test_the_description_names_every_tool_and_the_choice():
    text = describe_tools(tool_use([WEATHER, TIME], "required"))
    assert "get_weather" in text and "get_time" in text and "must call one" in text
