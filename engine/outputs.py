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
            out["logprobs"] = [
                {**lp.to_dict(), "top": {str(k): v for k, v in lp.top.items()}}  # JSON: str keys
                for lp in self.logprobs
            ]
        return out
