"""OpenAI's request bodies: reading them (size, UTF-8, JSON) and their field models.

Strict models: "16" is not an integer and true is not 1. Unknown fields are ignored, as
OpenAI's clients send fields this server has no use for. ``prompt`` and ``messages`` are
checked by hand, for clearer messages than a union's. Every problem is an :class:`APIError`
(400, or 413 for an oversize body) whose message says what is wrong.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

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
    user: str | None = None  # accepted and ignored
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
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


def single_prompt(prompt: Any) -> str | list[int]:
    """One prompt: a string, a list of token ids, or a list holding one of those."""
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise bad_request(
                f"batches of prompts are not supported: send one prompt per request "
                f"(got {len(prompt)})",
                "prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return prompt
    raise bad_request("prompt must be a string or a list of token ids", "prompt")


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
