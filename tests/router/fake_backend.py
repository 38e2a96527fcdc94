"""A deterministic in-process Backend for the router's tests (not part of the product).

It "generates" a fixed text (bytes of the tiny ByteTokenizer) in deltas of a few tokens,
stopping like the engine does (EOS, stop token ids, stop strings, max_tokens). It can be told
to refuse (``error``), to hang before the first delta or between deltas, and it records
every request it saw and every request closed before its end (``cancelled``).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from engine.sequence import TokenLogprobs
from engine.tiny import tiny_tokenizer
from router.backend import Backend, GenerateRequest, TokenDelta

DEFAULT_TEXT = "Hello, wörld! 😀 The quick brown fox jumps over the lazy dog. "


class FakeBackend(Backend):
    def __init__(self, max_model_len: int = 256, model_name: str = "tiny") -> None:
        self.model_name = model_name
        self.tokenizer = tiny_tokenizer()
        self.vocab_size = self.tokenizer.vocab_size
        self.max_model_len = max_model_len
        self.reset()

    def reset(self) -> None:
        """Back to the default behaviour (tests share one server and backend)."""
        self.text = DEFAULT_TEXT
        self.tokens_per_delta = 3
        self.delay_s = 0.0  # between deltas
        self.hang = False  # never produce a delta (until cancelled)
        self.error: Exception | None = None  # raised before the first delta
        self.fail_after_first = False  # finish_reason "error" after the first delta
        self.calls: list[GenerateRequest] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self.cancel_seen = threading.Event()  # set from the server's thread
        self.first_delta_sent = threading.Event()

    def output(self, request: GenerateRequest) -> tuple[list[int], str]:
        """The tokens the engine would produce, and why it would stop."""
        params = request.params
        stream = list(self.text.encode("utf-8")) * 64 + [self.tokenizer.EOS]
        out: list[int] = []
        for token in stream:
            out.append(token)
            if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
                return out, "stop"
            if token in params.stop_token_ids:
                return out, "stop"
            if params.stop and any(s in self.tokenizer.decode(out) for s in params.stop):
                return out, "stop"
            if len(out) >= params.max_tokens:
                return out, "length"
        return out, "length"

    async def generate(self, request: GenerateRequest):
        self.calls.append(request)
        if self.error is not None:
            raise self.error
        tokens, reason = self.output(request)
        done = False
        try:
            if self.hang:
                await asyncio.sleep(3600)
            k = self.tokens_per_delta
            for i in range(0, len(tokens), k):
                chunk = tokens[i : i + k]
                last = i + k >= len(tokens)
                if i and self.fail_after_first:
                    done = True
                    yield TokenDelta([], finish_reason="error", error="worker decode-0 died")
                    return
                if i and self.delay_s:
                    await asyncio.sleep(self.delay_s)
                done = last
                logprobs = None
                if request.params.logprobs is not None:
                    n = request.params.logprobs
                    logprobs = [
                        TokenLogprobs(t, -0.5, {t: -0.5, **{j: -1.0 - j for j in range(n)}})
                        for t in chunk
                    ]
                yield TokenDelta(chunk, logprobs, reason if last else None)
                self.first_delta_sent.set()
        finally:
            if done:
                self.finished.append(request.request_id)
            else:
                self.cancelled.append(request.request_id)
                self.cancel_seen.set()

    async def health(self) -> dict[str, Any]:
        return {"status": "ok", "prefill": 1, "decode": 1}

    def stats(self) -> dict[str, Any]:
        return {
            "queue_tokens": {"prefill-0": 12},
            "running": {"decode-0": 3},
            "kv_usage": {"decode-0": 0.25},
            "transfer_bytes_total": 1024,
            "transfer_seconds_total": 0.5,
            "router_waiting": 2,
            "prefix_cache_queries": {"prefill-0": 300},
            "prefix_cache_hits": {"prefill-0": 192},
            "kv_index_blocks": {"prefill-0": 40},
            "prefill_routing": {"overlap": 5, "load": 2},
        }
