"""Tools in chat: validating ``tools`` / ``tool_choice``, describing the tools to a model
whose chat template does not take them, the grammar that makes ``tool_choice: "required"``
(or a named function) a valid call. Reading the model's calls out of its answer is
router/tool_call_stream.py's job. No I/O.

A call is JSON ``{"name": ..., "arguments": {...}}`` (``"parameters"`` is read as
arguments too, as Llama models write it), alone, in a list, or inside ``<tool_call>`` tags
(Hermes / Qwen / SmolLM style). One reader parses an answer as it streams; the whole
answer is parsed by the same reader, so a response says the same thing streamed or not.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.structured_output import GrammarSpec
from router.errors import bad_request

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object


@dataclass(frozen=True)
class ToolUse:
    """The tools a request offers and how it may use them: ``choice`` is "auto",
    "required", or the one function's name that must be called."""

    tools: tuple[Tool, ...]
    choice: str

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def tool_use(tools: Any, tool_choice: Any) -> ToolUse | None:
    """The validated tools, or None when the request offers none (or ``tool_choice`` is
    "none": the model answers in text, without being told of them)."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of functions", "tools")
    parsed = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
        ):
            raise bad_request(
                f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools"
            )
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(
                f"tools[{i}].function.name must be 1-64 letters, digits, _ or -", "tools"
            )
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema", "tools")
        description = function.get("description", "")
        if not isinstance(description, str):
            raise bad_request(f"tools[{i}].function.description must be a string", "tools")
        parsed.append(Tool(name, description, parameters))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise bad_request("tools has two functions of the same name", "tools")
    if tool_choice is None or tool_choice == "auto":
        choice = "auto"
    elif tool_choice == "none":
        return None
    elif tool_choice == "required":
        choice = "required"
    elif (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
    ):
        choice = tool_choice["function"].get("name")
        if choice not in names:
            raise bad_request(f"tool_choice names {choice!r}, which is not in tools", "tool_choice")
    else:
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return ToolUse(tuple(parsed), choice)


def describe_tools(use: ToolUse) -> str:
    """A system message that tells a model whose template does not take tools about them."""
    listing = "\n".join(
        json.dumps(
            {"name": t.name, "description": t.description, "parameters": t.parameters},
            ensure_ascii=False,
        )
        for t in use.tools
    )
    if use.choice == "required":
        how = "You must call one of them."
    elif use.forced:
        how = f"You must call {use.choice}."
    else:
        how = "Call one only if it helps; otherwise answer normally."
    return (
        "You have access to these functions:\n"
        f"{listing}\n"
        f"{how} To call a function, answer with only a JSON object inside tags, as "
        '<tool_call>{"name": "<function name>", "arguments": {<its arguments>}}</tool_call>'
    )


def tool_grammar(use: ToolUse) -> GrammarSpec | None:
    """With a call forced, the grammar of the answer: one call, as a JSON object whose
    arguments follow the function's schema (any of the tools for "required")."""
    if not use.forced:
        return None
    tools = [t for t in use.tools if use.choice in ("required", t.name)]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return GrammarSpec("json_schema", json.dumps(schema))
