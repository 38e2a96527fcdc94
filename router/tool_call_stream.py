"""Reading a chat answer, with tools offered, into content and OpenAI ``tool_calls`` as it
streams (:class:`ToolCallStream`), and whole (:func:`tool_answer`, the same reader). Pure
functions: no I/O.
"""

from __future__ import annotations

import secrets
from typing import Any

from router.json_reader import WHITESPACE, JsonValue, Malformed, StringReader, render_object
from router.tool_calls import ToolUse


def tool_answer(text: str, use: ToolUse) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A whole answer's content and OpenAI ``tool_calls`` entries, exactly as
    :class:`ToolCallStream` streams them: ``(text, None)`` when it holds no call; with calls,
    the content is the text that is not part of one (None when there is none)."""
    stream = ToolCallStream(use)
    content = ""
    calls: list[dict[str, Any]] = []
    for part in stream.feed(text) + stream.finish():
        content += part.get("content", "")
        for piece in part.get("tool_calls", ()):
            if "id" in piece:  # a call's first piece
                calls.append({k: v for k, v in piece.items() if k != "index"})
                calls[-1]["function"] = dict(piece["function"])
            else:
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    if not calls:
        return content, None
    return content or None, calls


def parse_tool_calls(text: str, use: ToolUse) -> list[dict[str, Any]] | None:
    """The OpenAI ``tool_calls`` entries for the calls in ``text`` to the offered tools, or
    None when it holds none (it is then the answer's content)."""
    return tool_answer(text, use)[1]


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_ARGUMENT_KEYS = frozenset({"arguments", "parameters"})


class ToolCallStream:
    """One choice's answer read as it streams, with tools offered: ``feed`` each text delta,
    then ``finish``; each returns the OpenAI chat deltas to send, in order: ``{"content":
    ...}``, a call's first piece ``{"tool_calls": [{"index", "id", "type", "function":
    {"name", "arguments": ""}}]}`` (sent once its name is known to be an offered tool's),
    then its argument pieces ``{"tool_calls": [{"index", "function": {"arguments"}}]}``.

    A call starts, after whitespace, at the start of the answer or after another call, as a
    JSON object or a list of them, or anywhere as ``<tool_call>`` (closed by an optional
    ``</tool_call>``). Text that could still be the start of one is held back; once it
    cannot be, it is sent as content. Content and calls may alternate; whitespace between
    calls, or between a call and the answer's start or end, is dropped.

    Arguments (an object, or a string holding one) are sent as ``json.dumps(arguments,
    ensure_ascii=False)`` renders them, and a piece only once no later text can change it:
    ``{``, ``[``, ``: ``, ``, `` and closing brackets when their character is read, a key at
    its closing quote, a string's characters as they are decoded (an escape once complete; a
    ``\\uD8xx`` escape once it is known whether a low surrogate follows), a number at the
    character after it (``1E2`` renders ``100.0``), ``true``/``false``/``null`` once whole.
    What is sent is thus always a prefix of the rendering of any valid completion of the
    text, and when the object closes it is all of it. Arguments written as a string are sent
    whole at its closing quote. JSON is read strictly (no NaN, no key twice in an object:
    json.loads would keep the last value at the first one's place, which a sent prefix
    cannot follow).

    Where the text stops being a call (malformed JSON, a name that is not an offered tool's,
    no name), what was held back is sent as content and content continues. A call whose name
    was sent stays a call: its arguments are what was sent so far (not whole JSON, as when
    max_tokens cuts a call off), and the text not rendered in them goes out as content.
    """

    def __init__(self, use: ToolUse) -> None:
        self.num_calls = 0
        self._names = frozenset(t.name for t in use.tools)
        self._out: list[dict[str, Any]] = []
        self._mode = "between"  # between (calls), content, tag (after <tool_call>), json
        self._held = ""  # text read but not sent: content unless a call accounts for it
        self._closing = False  # between: a tagged call ended, its </tool_call> may follow
        self._tagged = False  # json: the call is inside <tool_call>
        self._list = False  # json: a list of calls
        self._list_state = "item"  # json list: item (a call must come) or next ("," or "]")
        self._call: _Call | None = None
        self._index: int | None = None  # the current call's index once its name was sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas to send for the answer's next ``text``."""
        modes = {
            "between": self._between,
            "content": self._content,
            "tag": self._tag,
            "json": self._json,
        }
        while text:
            text = modes[self._mode](text)  # each reads a prefix, returns the rest
        return self._take()

    def finish(self) -> list[dict[str, Any]]:
        """At the answer's end: what is still held back, as content (only whitespace after a
        call is dropped)."""
        if not (self.num_calls and not self._held.strip(WHITESPACE)):
            self._send(self._held)
        self._held = ""
        return self._take()

    # ---- the modes: each reads from ``text`` while it lasts, returns what it did not read
    def _between(self, text: str) -> str:
        for i, ch in enumerate(text):
            tag = self._held.lstrip(WHITESPACE) + ch
            if _OPEN.startswith(tag) or (self._closing and _CLOSE.startswith(tag)):
                self._held += ch
                if tag == _OPEN:
                    self._mode, self._closing = "tag", False
                    return text[i + 1 :]
                if tag == _CLOSE:
                    self._held, self._closing = "", False
            elif tag == ch and ch in WHITESPACE:
                self._held += ch
            elif tag == ch and ch in "{[":
                self._start_json(ch, tagged=False)
                return text[i + 1 :]
            else:
                self._to_content()
                return text[i:]
        return ""

    def _content(self, text: str) -> str:
        text = self._held + text
        at = text.find(_OPEN)
        if at >= 0:
            self._send(text[:at])
            self._held, self._mode = _OPEN, "tag"
            return text[at + len(_OPEN) :]
        # Hold back a tail that may be the start of <tool_call>.
        keep = next((k for k in range(len(_OPEN) - 1, 0, -1) if text.endswith(_OPEN[:k])), 0)
        self._send(text[: len(text) - keep])
        self._held = text[len(text) - keep :]
        return ""

    def _tag(self, text: str) -> str:
        for i, ch in enumerate(text):
            if ch in "{[":
                self._start_json(ch, tagged=True)
                return text[i + 1 :]
            if ch not in WHITESPACE:
                self._to_content()
                return text[i:]
            self._held += ch
        return ""

    def _json(self, text: str) -> str:
        for i, ch in enumerate(text):
            try:
                settled = self._json_char(ch)
            except Malformed:  # not (or no longer) a call: what it held back is content
                self._call = self._index = None
                self._to_content()
                return text[i:]
            # Settled: all read so far is in what was sent (whitespace dropped).
            self._held = "" if settled else self._held + ch
            if self._mode != "json":
                return text[i + 1 :]
        return ""

    # ---- helpers ----------------------------------------------------------------------
    def _start_json(self, ch: str, tagged: bool) -> None:
        self._held += ch
        self._mode, self._tagged, self._closing = "json", tagged, False
        self._list, self._list_state = ch == "[", "item"
        self._call = None if self._list else _Call(self._names)

    def _json_char(self, ch: str) -> bool:
        call = self._call
        if call is None:  # in a list, between its calls
            if ch in WHITESPACE:
                return False
            if ch == "{" and self._list_state == "item":
                self._call = _Call(self._names)
                return False
            if ch == "," and self._list_state == "next":
                self._list_state = "item"
                return False
            if ch == "]" and self._list_state == "next":
                self._end_json()
                return True
            raise Malformed
        settled = call.step(ch)
        if self._index is None and call.name is not None:
            self._index = self.num_calls
            self.num_calls += 1
            self._out.append(
                {
                    "tool_calls": [
                        {
                            "index": self._index,
                            "id": f"call_{secrets.token_hex(12)}",
                            "type": "function",
                            "function": {"name": call.name, "arguments": ""},
                        }
                    ]
                }
            )
        if self._index is None:
            return False
        self._arguments(self._index, call.take())
        if call.done:
            self._call = self._index = None
            if self._list:
                self._list_state = "next"
            else:
                self._end_json()
        return settled

    def _end_json(self) -> None:
        self._mode, self._closing = "between", self._tagged

    def _to_content(self) -> None:
        self._send(self._held)
        self._held, self._mode = "", "content"

    def _send(self, text: str) -> None:
        if not text:
            return
        if self._out and "content" in self._out[-1]:
            self._out[-1]["content"] += text
        else:
            self._out.append({"content": text})

    def _arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self._out[-1]["tool_calls"][0] if self._out and "tool_calls" in self._out[-1] else {}
        if last.get("index") == index and "id" not in last:  # merged into this delta's piece
            last["function"]["arguments"] += text
        else:
            self._out.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})

    def _take(self) -> list[dict[str, Any]]:
        out, self._out = self._out, []
        return out


class _Call:
    """A call object's text after its ``{``, a character at a time: ``name`` (set at its
    closing quote, if an offered tool's), ``arguments`` or ``parameters`` (an object, or a
    string holding one; ``{}`` when absent), other members read and ignored. ``step`` raises
    Malformed where the text stops being one."""

    def __init__(self, names: frozenset[str]) -> None:
        self.name: str | None = None
        self.done = False
        self._names = names
        self._rendered: list[str] = []  # arguments rendered, not yet taken
        self._seen: set[str] = set()
        self._state = "first_key"
        self._key = ""
        self._text = ""  # the key, name or arguments string being read
        self._string: StringReader | None = None
        self._value: JsonValue | None = None  # the arguments object, or an ignored value

    def take(self) -> str:
        """The arguments' rendering since the last take."""
        text = "".join(self._rendered)
        self._rendered.clear()
        return text

    def step(self, ch: str) -> bool:
        """Read ``ch``; True when all read so far is in the name and the arguments rendered."""
        state = self._state
        if state in ("key", "name", "arguments_string"):
            self._text += self._string.step(ch)
            if not self._string.closed:
                return False
            text, self._text, self._string = self._text, "", None
            if state == "key":
                if text in self._seen or (text in _ARGUMENT_KEYS and self._seen & _ARGUMENT_KEYS):
                    raise Malformed  # which one would be meant is a guess
                self._seen.add(text)
                self._key, self._state = text, "colon"
                return False
            if state == "name":
                if text not in self._names:
                    raise Malformed  # not a call to an offered tool
                self.name = text
            else:
                self._rendered.append(render_object(text))
            self._state = "next"
            return True
        if state in ("arguments", "other"):
            consumed = self._value.step(ch)
            if self._value.done:
                self._state = "next"
            if state == "other":  # a number ends at the character after it
                return False if consumed else self.step(ch)
            self._rendered.append(self._value.take())
            return not self._value.pending
        if ch in WHITESPACE:
            return False
        if state in ("first_key", "key_start") and ch == '"':
            self._string, self._state = StringReader(), "key"
            return False
        if state in ("first_key", "next") and ch == "}":
            if self.name is None:
                raise Malformed
            if not self._seen & _ARGUMENT_KEYS:
                self._rendered.append("{}")
            self.done, self._state = True, "done"
            return True
        if state == "next" and ch == ",":
            self._state = "key_start"
            return False
        if state == "colon" and ch == ":":
            self._state = "value"
            return False
        if state == "value":
            if self._key == "name" and ch == '"':
                self._string, self._state = StringReader(), "name"
                return False
            if self._key in _ARGUMENT_KEYS and ch == '"':
                self._string, self._state = StringReader(), "arguments_string"
                return False
            if self._key in _ARGUMENT_KEYS and ch == "{":
                self._value, self._state = JsonValue(), "arguments"
                return self.step(ch)
            if self._key not in _ARGUMENT_KEYS and self._key != "name":
                self._value, self._state = JsonValue(), "other"
                return self.step(ch)
        raise Malformed
