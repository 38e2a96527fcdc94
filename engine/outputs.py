"""What the engine returns for a finished request."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # entry 0 (no context) is None
    metrics: dict[str, float] = field(default_factory=dict)  # ttft_s, latency_s

    def to_dict(self) -> dict:
        out = {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "num_cached_tokens": self.num_cached_tokens,
            "metrics": self.metrics,
        }
        if self.logprobs is not None:
            out["logprobs"] = [_json(lp) for lp in self.logprobs]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [
                None if lp is None else _json(lp) for lp in self.prompt_logprobs
            ]
        return out


def _json(lp: TokenLogprobs) -> dict:
    return {**lp.to_dict(), "top": {str(k): v for k, v in lp.top.items()}}  # JSON: str keys
