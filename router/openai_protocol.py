"""OpenAI's request bodies: reading them (size, UTF-8, JSON) and their field models.

Strict models: "16" is not an integer and true is not 1. Every official OpenAI field is
either served or, when set to anything but its "off" value, refused with a 400 that names it
(``UNSERVED``); fields that are not OpenAI's are ignored unless they are one of the extras
this server serves (vLLM's names: top_k, min_tokens, ignore_eos, stop_token_ids,
repetition_penalty, return_token_ids; and return_timings). ``prompt`` and ``messages`` are
checked by hand, for clearer messages than a union's. Every problem is an :class:`APIError`
(400, or 413 for an oversize body) whose message says what is wrong.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from engine.structured_output import GrammarSpec
from router.errors import APIError, bad_request


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class CommonRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # identifiers: accepted, not used
    prompt_cache_key: str | None = None  # the prefix cache needs no hint
    safety_identifier: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's structured output extras (one at most, or response_format in chat)
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    return_token_ids: bool = False
    return_timings: bool = False  # pdcluster: the first token's way, per stage (ms)


class CompletionRequest(CommonRequest):
    prompt: Any = None
    logprobs: int | None = None
    echo: bool = False


class ChatCompletionRequest(CommonRequest):
    messages: Any = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: Any = None  # checked in router.tool_calls
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # more than one call may come back either way


# Official fields not served: absent, null or one of these values ("off"), else a 400.
UNSERVED: dict[str, dict[str, tuple]] = {
    "completion": {
        "best_of": (1,),
        "suffix": ("",),
    },
    "chat": {
        "audio": (),
        "function_call": ("none",),
        "functions": ([],),
        "metadata": (),
        "modalities": (["text"],),
        "prediction": (),
        "reasoning_effort": (),
        "service_tier": ("auto", "default"),
        "store": (False,),
        "verbosity": (),
        "web_search_options": (),
    },
}


def refuse_unserved(body: dict[str, Any], kind: str) -> None:
    """A 400 naming the first official field ``body`` sets that this server does not serve."""
    for name, off in UNSERVED[kind].items():
        value = body.get(name)
        if value is None or any(value == v and type(value) is type(v) for v in off):
            continue
        shown = repr(value)[:60]
        hint = f" (only {' or '.join(json.dumps(v) for v in off)})" if off else ""
        raise bad_request(f"{name} is not supported by this server{hint}, got {shown}", name)


def grammar_of(req: CommonRequest) -> tuple[str, GrammarSpec] | None:
    """The grammar a request's output must follow and the field that asked for it: chat's
    response_format, or one of vLLM's extras (structured_outputs: json | regex | choice |
    grammar, or guided_*)."""
    asked: list[tuple[str, GrammarSpec]] = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            asked.append(("response_format", spec))
    extras = dict(req.structured_outputs or {})
    for short in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{short}")
        if value is not None:
            extras.setdefault(short, value)
    for key, value in extras.items():
        param = "structured_outputs"
        if key == "json":
            asked.append((param, _json_spec(value, param)))
        elif key == "regex" and isinstance(value, str) and value:
            asked.append((param, GrammarSpec("regex", value)))
        elif key == "grammar" and isinstance(value, str) and value:
            asked.append((param, GrammarSpec("grammar", value)))
        elif key == "choice" and (
            isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)
        ):
            asked.append((param, GrammarSpec.choice(value)))
        elif key in ("json", "regex", "grammar", "choice"):
            raise bad_request(f"structured_outputs.{key} has the wrong type, got {value!r}", param)
        else:
            raise bad_request(
                f"structured_outputs.{key} is not supported (json, regex, choice or grammar)",
                param,
            )
    if len(asked) > 1:
        names = sorted({name for name, _ in asked})
        raise bad_request(f"ask for one output format at most, got {len(asked)}", names[0])
    return asked[0] if asked else None


def _response_format(value: dict[str, Any]) -> GrammarSpec | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise bad_request(
                "response_format.json_schema must be an object with a schema", "response_format"
            )
        return _json_spec(inner["schema"], "response_format")
    raise bad_request(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        "response_format",
    )


def _json_spec(schema: Any, param: str) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise bad_request(f"the JSON schema is not valid JSON: {err}", param) from None
    if not isinstance(schema, dict):
        raise bad_request("a JSON schema must be an object", param)
    return GrammarSpec("json_schema", json.dumps(schema))


_UNION_HINTS = {"stop": "a string or a list of strings"}
_ROLES = ("system", "developer", "user", "assistant", "tool")


def validation_error(err: ValidationError) -> APIError:
    first = err.errors()[0]
    loc = first["loc"]
    name = str(loc[0]) if loc else None
    got = repr(first.get("input"))[:60]
    if name in _UNION_HINTS:
        return bad_request(f"{name} must be {_UNION_HINTS[name]}, got {got}", name)
    path = ".".join(str(p) for p in loc)
    return bad_request(f"{path}: {first['msg'].lower()}, got {got}", name)


def prompt_list(prompt: Any, limit: int) -> list[str | list[int]]:
    """The prompts of a completions request: a string, a list of token ids, or a list of
    those (at most ``limit``), each its own choice, in order."""
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) > limit:
            raise bad_request(
                f"a request may hold at most {limit} prompts, got {len(prompt)}", "prompt"
            )
        prompts = prompt
    else:
        prompts = [prompt]
    for i, one in enumerate(prompts):
        if isinstance(one, str):
            continue
        if isinstance(one, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in one
        ):
            continue
        where = f"prompt[{i}]" if prompts is prompt else "prompt"
        raise bad_request(f"{where} must be a string or a list of token ids", "prompt")
    return prompts


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages with text content (content parts of type "text" are joined)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise bad_request(
                f"messages[{i}] must be an object with a role in {list(_ROLES)}", "messages"
            )
        content = m.get("content")
        if m.get("role") == "assistant" and m.get("tool_calls") and not content:
            content = _calls_as_text(m["tool_calls"], i)
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise bad_request(
                    f"messages[{i}].content: only text parts are supported", "messages"
                )
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad_request(
                f"messages[{i}].content must be a string or a list of text parts", "messages"
            )
        out.append({**m, "content": content})
    return out


def _calls_as_text(calls: Any, i: int) -> str:
    """An earlier assistant turn's tool calls, as the model writes them (for a template
    that does not render ``tool_calls`` itself)."""
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
    parts = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"messages[{i}].tool_calls entries need a function name", "messages")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            raise bad_request(
                f"messages[{i}].tool_calls arguments must be JSON", "messages"
            ) from None
        body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
        parts.append(f"<tool_call>{body}</tool_call>")
    return "\n".join(parts)


async def read_json_body(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object: at most ``limit`` bytes (413), UTF-8, JSON without NaN."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(
                413, f"request body is larger than {limit} bytes", code="request_too_large"
            )
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise bad_request(f"request body is not valid UTF-8 (byte {err.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise bad_request(f"request body is not valid JSON: {err}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:  # "\ud800" escapes decode to lone surrogates, which no tokenizer can encode
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            "request body contains an invalid Unicode escape (lone surrogate)"
        ) from None
    return data


def _reject_constant(name: str) -> Any:
    raise bad_request(f"request body is not valid JSON: {name} is not a number")
