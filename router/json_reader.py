"""An incremental JSON reader: a value's text read a character at a time and rendered
piece by piece as ``json.dumps(value, ensure_ascii=False)`` renders it, each piece once no
later text can change it (router/tool_call_stream.py streams tool-call arguments with it).
Strict: what json.loads would refuse, or read differently, raises :class:`Malformed`.
"""

from __future__ import annotations

import json
import re

WHITESPACE = " \t\n\r"  # JSON's


class Malformed(Exception):
    """The text read is not (the start of) what was expected."""


def render_object(text: str) -> str:
    """The JSON object ``text`` holds, rendered as json.dumps(..., ensure_ascii=False) would."""
    body = text.strip(WHITESPACE)
    if not body.startswith("{"):
        raise Malformed
    value = JsonValue()
    for ch in body:
        value.step(ch)
    if not value.done:
        raise Malformed
    return value.take()


_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")


class JsonValue:
    """One JSON value's text, a character at a time, rendered piece by piece as
    json.dumps(value, ensure_ascii=False) renders it, each piece once certain (the rule is
    in ToolCallStream's docstring). ``step`` raises Malformed where the text stops being
    JSON."""

    def __init__(self) -> None:
        self.done = False
        self._out: list[str] = []
        self._stack: list[set[str] | None] = []  # open containers: an object's keys, None: a list
        self._state = "value"
        self._token = ""  # the raw text of the number, literal or key being read
        self._key = ""  # that key's text, decoded
        self._string: StringReader | None = None

    @property
    def pending(self) -> bool:
        """Whether some text read is not rendered yet."""
        return bool(self._token) or (self._string is not None and bool(self._string.escape))

    def take(self) -> str:
        text = "".join(self._out)
        self._out.clear()
        return text

    def step(self, ch: str) -> bool:
        """Read ``ch``; False when it is not part of the value (it ended a lone number)."""
        state = self._state
        if state == "string":
            text = self._string.step(ch)
            if text:
                self._out.append(json.dumps(text, ensure_ascii=False)[1:-1])
            if self._string.closed:
                self._out.append('"')
                self._string = None
                self._end_value()
            return True
        if state == "key":
            self._token += ch
            self._key += self._string.step(ch)
            if self._string.closed:
                keys = self._stack[-1]
                if self._key in keys:
                    raise Malformed
                keys.add(self._key)
                self._out.append(json.dumps(self._key, ensure_ascii=False))
                self._token, self._key, self._string, self._state = "", "", None, "colon"
            return True
        if state == "number":
            if ch in _NUMBER_CHARS:
                self._token += ch
                return True
            if not _NUMBER.fullmatch(self._token):
                raise Malformed
            self._out.append(json.dumps(json.loads(self._token)))
            self._token = ""
            self._end_value()
            return not self.done and self.step(ch)
        if state == "literal":
            self._token += ch
            if not any(word.startswith(self._token) for word in _LITERALS):
                raise Malformed
            if self._token in _LITERALS:
                self._out.append(self._token)
                self._token = ""
                self._end_value()
            return True
        if state == "done":
            raise Malformed
        if ch in WHITESPACE:
            return True
        if state == "value" or (state == "first_item" and ch != "]"):
            self._start(ch)
        elif state in ("first_key", "key_start") and ch == '"':
            self._token, self._string, self._state = ch, StringReader(), "key"
        elif state == "colon" and ch == ":":
            self._out.append(": ")
            self._state = "value"
        elif state == "next" and ch == ",":
            self._out.append(", ")
            self._state = "value" if self._stack[-1] is None else "key_start"
        elif (
            (state == "first_item" and ch == "]")
            or (state == "first_key" and ch == "}")
            or (state == "next" and ch == ("]" if self._stack[-1] is None else "}"))
        ):
            self._out.append(ch)
            self._stack.pop()
            self._end_value()
        else:
            raise Malformed
        return True

    def _start(self, ch: str) -> None:
        if ch == "{":
            self._stack.append(set())
            self._state = "first_key"
        elif ch == "[":
            self._stack.append(None)
            self._state = "first_item"
        elif ch == '"':
            self._string, self._state = StringReader(), "string"
        elif ch in "-0123456789":
            self._token, self._state = ch, "number"
            return
        elif ch in "tfn":
            self._token, self._state = ch, "literal"
            return
        else:
            raise Malformed
        self._out.append(ch)

    def _end_value(self) -> None:
        self.done = not self._stack
        self._state = "done" if self.done else "next"


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


class StringReader:
    """A JSON string's text after its opening quote, a character at a time, decoded as
    json.loads decodes it: ``step`` returns the text that became certain (an escape once
    complete; a high surrogate's once it is known whether a low one follows to pair with);
    ``closed`` at the closing quote. Raises Malformed where it stops being a string."""

    def __init__(self) -> None:
        self.escape = ""  # an escape begun, not yet decoded
        self.closed = False

    def step(self, ch: str) -> str:
        if not self.escape:
            if ch == '"':
                self.closed = True
                return ""
            if ch == "\\":
                self.escape = ch
                return ""
            if ch < " ":
                raise Malformed  # control characters must be escaped
            return ch
        self.escape += ch
        return self._decode()

    def _decode(self) -> str:
        e = self.escape
        if e[1] != "u":
            if e[1] not in _ESCAPES:
                raise Malformed
            self.escape = ""
            return _ESCAPES[e[1]]
        if not _HEX.issuperset(e[2:6]):
            raise Malformed
        if len(e) < 6:
            return ""
        code = int(e[2:6], 16)
        if not 0xD800 <= code < 0xDC00:
            self.escape = ""
            return chr(code)
        rest = e[6:]  # after a high surrogate
        if rest in ("", "\\"):
            return ""
        if rest.startswith("\\u") and _HEX.issuperset(rest[2:]):
            if len(rest) < 6:
                return ""
            low = int(rest[2:], 16)
            if 0xDC00 <= low < 0xE000:
                self.escape = ""
                return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00))
        self.escape = ""  # a lone surrogate, kept as json.loads keeps it; the rest read anew
        return chr(code) + "".join(self.step(c) for c in rest)
