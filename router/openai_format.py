"""OpenAI's response formats: a prepared request's result as a completion or chat
completion, whole or as stream chunks. Presentation only: no I/O, no backend calls.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.sequence import TokenLogprobs
from router.backend import GenerateRequest
from router.generation import TextDelta, logprob_entries, token_text
from router.tool_call_stream import ToolCallStream, tool_answer
from router.tool_calls import ToolUse


@dataclass
class Prepared:
    """A validated request and how to present its result: one choice per entry of
    ``requests`` (a completions request may hold several prompts), index = position."""

    kind: Literal["completion", "chat"]
    request_id: str
    requests: list[GenerateRequest]  # n consecutive choices per prompt
    model: str
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: bool
    return_timings: bool = False
    n: int = 1
    echo: list[str] | None = None  # completions with echo: each choice's prompt text
    grammar_param: str | None = None  # the field that asked for a grammar, if one did
    tools: ToolUse | None = None  # chat with tools: the answer may be calls
    created: int = field(default_factory=lambda: int(time.time()))
    # completions logprobs: where each choice's next token's text starts
    text_offsets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.text_offsets = [len(e) for e in self.echo] if self.echo else [0] * len(self.requests)


class ResponseFormat:
    """Builds the JSON bodies of one server's responses (``tokenizer`` for logprob text)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def envelope(self, prep: Prepared, chunk: bool) -> dict[str, Any]:
        if prep.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": prep.request_id, "object": obj, "created": prep.created, "model": prep.model}

    def chunk(self, prep: Prepared, index: int, delta: TextDelta, is_first: bool) -> dict:
        """One stream chunk: choice ``index``'s ``delta`` (its first when ``is_first``)."""
        out = self.envelope(prep, chunk=True)
        text = delta.text
        if prep.echo and is_first:
            text = prep.echo[index] + text
        out["choices"] = [
            self._choice(
                prep,
                index,
                text,
                delta.token_ids,
                delta.logprobs,
                delta.finish_reason,
                True,
                is_first,
                delta.prompt_logprobs if is_first else None,
            )
        ]
        self.chunk_extras(out, prep, index, is_first, delta.timings)
        return out

    @staticmethod
    def chunk_extras(
        out: dict[str, Any],
        prep: Prepared,
        index: int,
        is_first: bool,
        timings: dict[str, float] | None,
    ) -> None:
        """What a stream chunk carries besides its choice: usage (null until the usage
        chunk), the prompt's token ids on the first, the timings on the last."""
        if prep.include_usage:
            out["usage"] = None
        if prep.return_token_ids and is_first:
            out["prompt_token_ids"] = prep.requests[index].prompt_token_ids
        if prep.return_timings and timings:
            out["timings_ms"] = _milliseconds(timings)

    def tool_stream(self, prep: Prepared, index: int) -> ToolChunks:
        """Choice ``index`` of a streamed chat answer with tools offered, as chunks."""
        return ToolChunks(self, prep, index)

    def usage_chunk(
        self, prep: Prepared, completion_tokens: int, cached: list[int | None] | None = None
    ) -> dict[str, Any]:
        chunk = self.envelope(prep, chunk=True)
        chunk.update(choices=[], usage=self.usage(prep, completion_tokens, cached))
        return chunk

    def full_response(self, prep: Prepared, results: list[list[TextDelta]]) -> dict[str, Any]:
        """The whole response: ``results[i]`` holds choice i's deltas, in order."""
        out = self.envelope(prep, chunk=False)
        out["choices"] = []
        num_tokens = 0
        timings = None
        for index, deltas in enumerate(results):
            token_ids = [t for d in deltas for t in d.token_ids]
            logprobs = [lp for d in deltas for lp in (d.logprobs or ())]
            text = (prep.echo[index] if prep.echo else "") + "".join(d.text for d in deltas)
            num_tokens += len(token_ids)
            out["choices"].append(
                self._choice(
                    prep,
                    index,
                    text,
                    token_ids,
                    logprobs,
                    deltas[-1].finish_reason,
                    False,
                    False,
                    deltas[0].prompt_logprobs,
                )
            )
            timings = timings or next((d.timings for d in deltas if d.timings), None)
        cached = [deltas[-1].cached_tokens for deltas in results]
        out["usage"] = self.usage(prep, num_tokens, cached)
        if prep.return_token_ids:
            ids = [r.prompt_token_ids for r in prep.requests[:: prep.n]]
            out["prompt_token_ids"] = ids[0] if len(ids) == 1 else ids
        if prep.return_timings and timings:
            out["timings_ms"] = _milliseconds(timings)
        return out

    @staticmethod
    def usage(
        prep: Prepared, completion_tokens: int, cached: list[int | None] | None = None
    ) -> dict[str, Any]:
        """``cached``: each choice's prompt tokens served from a prefix cache (None: not
        known); a prompt's n choices share its prefill, so it counts once per prompt."""
        prompts = prep.requests[:: prep.n]
        prompt = sum(len(r.prompt_token_ids) for r in prompts)  # once per prompt
        out: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }
        firsts = (cached or [])[:: prep.n]
        if firsts and all(c is not None for c in firsts):
            # a migrated request's last prompt held its streamed tokens too: at most its prompt
            served = sum(
                min(c, len(r.prompt_token_ids)) for c, r in zip(firsts, prompts, strict=False)
            )
            out["prompt_tokens_details"] = {"cached_tokens": served}
        return out

    def _choice(
        self, prep, index, text, token_ids, logprobs, finish, chunk, is_first, prompt_logprobs=None
    ):
        if prep.kind == "completion":
            choice: dict[str, Any] = {"index": index, "text": text}
        elif chunk:
            delta = {"role": "assistant", "content": text} if is_first else {"content": text}
            choice = {"index": index, "delta": delta}
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if prep.tools is not None:
                content, calls = tool_answer(text, prep.tools)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish = _finish(finish, called=True)
            choice = {"index": index, "message": message}
        choice["logprobs"] = (
            self._logprobs(prep, index, logprobs, prompt_logprobs) if prep.logprobs else None
        )
        choice["finish_reason"] = finish
        if prep.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _logprobs(
        self,
        prep: Prepared,
        index: int,
        logprobs: list[TokenLogprobs] | None,
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
    ) -> dict[str, Any]:
        entries = logprob_entries(self.tokenizer, logprobs or [])
        if prep.kind == "chat":
            return {
                "content": [
                    {
                        "token": tok,
                        "logprob": lp,
                        "bytes": list(tok.encode("utf-8", "replace")),
                        "top_logprobs": [
                            {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))}
                            for t, v in top
                        ],
                    }
                    for tok, lp, top in entries
                ]
            }
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        if prompt_logprobs:  # echo: the prompt's tokens first, the first without context
            prompt_ids = prep.requests[index].prompt_token_ids
            offset = 0
            for token_id, entry in zip(prompt_ids, prompt_logprobs, strict=True):
                if entry is None:
                    tok, lp, top = token_text(self.tokenizer, token_id), None, None
                else:
                    ((tok, lp, pairs),) = logprob_entries(self.tokenizer, [entry])
                    top = dict(pairs)
                self._append_logprob(out, tok, lp, top, offset)
                offset += len(tok)
        for tok, lp, top in entries:
            self._append_logprob(out, tok, lp, dict(top), prep.text_offsets[index])
            prep.text_offsets[index] += len(tok)
        return out

    @staticmethod
    def _append_logprob(out: dict[str, list], tok: str, lp, top, offset: int) -> None:
        out["tokens"].append(tok)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)


class ToolChunks:
    """Choice ``index`` of a streamed chat answer with tools offered: ``add`` each delta and
    send the chunks it returns, one per piece its ToolCallStream releases (content, or a
    call's first piece, or argument text), then, at the finish, one with the finish reason.

    Token ids and logprobs ride on the first chunk sent after their tokens arrived, content
    or call alike (the finish chunk carries any left): each is sent once, in order, and
    together they are the non-streamed choice's."""

    def __init__(self, fmt: ResponseFormat, prep: Prepared, index: int) -> None:
        assert prep.tools is not None
        self._format, self._prep, self._index = fmt, prep, index
        self._parser = ToolCallStream(prep.tools)
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprobs] = []
        self._first = True

    def add(self, delta: TextDelta) -> list[dict[str, Any]]:
        self._token_ids += delta.token_ids
        self._logprobs += delta.logprobs or []
        parts = self._parser.feed(delta.text)
        if delta.finish_reason is None:
            return [self._chunk(part) for part in parts]
        parts += self._parser.finish()
        finish = _finish(delta.finish_reason, called=self._parser.num_calls > 0)
        return [self._chunk(part) for part in parts] + [self._chunk({}, finish, delta.timings)]

    def _chunk(
        self,
        part: dict[str, Any],
        finish: str | None = None,
        timings: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        prep = self._prep
        out = self._format.envelope(prep, chunk=True)
        choice: dict[str, Any] = {
            "index": self._index,
            "delta": {"role": "assistant", **part} if self._first else part,
            "logprobs": None,
            "finish_reason": finish,
        }
        if prep.logprobs:
            choice["logprobs"] = self._format._logprobs(prep, self._index, self._logprobs)
        if prep.return_token_ids:
            choice["token_ids"] = self._token_ids
        out["choices"] = [choice]
        self._format.chunk_extras(out, prep, self._index, self._first, timings)
        self._token_ids, self._logprobs, self._first = [], [], False
        return out


def _finish(finish: str | None, called: bool) -> str | None:
    """The finish reason of an answer: "tool_calls" for one that made calls and stopped."""
    return "tool_calls" if called and finish == "stop" else finish


def _milliseconds(seconds: dict[str, float]) -> dict[str, float]:
    return {stage: round(value * 1e3, 3) for stage, value in seconds.items()}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
