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
from router.generation import TextDelta, logprob_entries
from router.tool_calls import ToolUse, parse_tool_calls


@dataclass
class Prepared:
    """A validated request and how to present its result: one choice per entry of
    ``requests`` (a completions request may hold several prompts), index = position."""

    kind: Literal["completion", "chat"]
    request_id: str
    requests: list[GenerateRequest]
    model: str
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: bool
    return_timings: bool = False
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
            )
        ]
        if prep.include_usage:
            out["usage"] = None
        if prep.return_token_ids and is_first:
            out["prompt_token_ids"] = prep.requests[index].prompt_token_ids
        if prep.return_timings and delta.timings:
            out["timings_ms"] = _milliseconds(delta.timings)
        return out

    def tool_chunks(self, prep: Prepared, deltas: list[TextDelta]) -> list[dict[str, Any]]:
        """A whole chat answer with tools offered, as stream chunks: its calls (each with its
        arguments in one piece) or its text, then the finish."""
        whole = self.full_response(prep, [deltas])
        choice = whole["choices"][0]
        message = choice["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        chunks = []
        for part, finish in ((delta, None), ({}, choice["finish_reason"])):
            out = self.envelope(prep, chunk=True)
            entry = {"index": 0, "delta": part, "logprobs": None, "finish_reason": finish}
            if finish is None and prep.logprobs:
                entry["logprobs"] = choice["logprobs"]
            out["choices"] = [entry]
            if prep.include_usage:
                out["usage"] = None
            chunks.append(out)
        return chunks

    def usage_chunk(self, prep: Prepared, completion_tokens: int) -> dict[str, Any]:
        chunk = self.envelope(prep, chunk=True)
        chunk.update(choices=[], usage=self.usage(prep, completion_tokens))
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
                )
            )
            timings = timings or next((d.timings for d in deltas if d.timings), None)
        out["usage"] = self.usage(prep, num_tokens)
        if prep.return_token_ids:
            ids = [r.prompt_token_ids for r in prep.requests]
            out["prompt_token_ids"] = ids[0] if len(ids) == 1 else ids
        if prep.return_timings and timings:
            out["timings_ms"] = _milliseconds(timings)
        return out

    @staticmethod
    def usage(prep: Prepared, completion_tokens: int) -> dict[str, int]:
        prompt = sum(len(r.prompt_token_ids) for r in prep.requests)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    def _choice(self, prep, index, text, token_ids, logprobs, finish, chunk, is_first):
        if prep.kind == "completion":
            choice: dict[str, Any] = {"index": index, "text": text}
        elif chunk:
            delta = {"role": "assistant", "content": text} if is_first else {"content": text}
            choice = {"index": index, "delta": delta}
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            calls = parse_tool_calls(text, prep.tools) if prep.tools is not None else None
            if calls:
                message = {"role": "assistant", "content": None, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
            choice = {"index": index, "message": message}
        choice["logprobs"] = self._logprobs(prep, index, logprobs) if prep.logprobs else None
        choice["finish_reason"] = finish
        if prep.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _logprobs(
        self, prep: Prepared, index: int, logprobs: list[TokenLogprobs] | None
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
        offsets = []
        for tok, _, _ in entries:
            offsets.append(prep.text_offsets[index])
            prep.text_offsets[index] += len(tok)
        return {
            "tokens": [tok for tok, _, _ in entries],
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries],
            "text_offset": offsets,
        }


def _milliseconds(seconds: dict[str, float]) -> dict[str, float]:
    return {stage: round(value * 1e3, 3) for stage, value in seconds.items()}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
