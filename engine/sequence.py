"""One request's tokens and its progress through the engine."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # admitted, prompt (or part of it) still to prefill; or preempted
    RUNNING = "running"  # prompt done, decoding
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: dict[int, float]

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": self.top}


@dataclass(frozen=True)
class Fork:
    """Another sequence of a request's prompt (OpenAI's ``n``): it shares the prompt's KV
    blocks and samples with its own params (its own seed) from the prompt's last logits."""

    request_id: str
    params: SamplingParams


_ids = itertools.count()


@dataclass
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_cached_tokens: int = 0  # of those, served by the prefix cache (last admission)
    block_table: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # of block_table, published to the prefix cache
    # swapped out on preemption: its computed blocks' host slots (engine/host_kv_tier.py),
    # loaded back into fresh blocks when it is admitted again
    swapped_slots: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # stop | length | abort
    stop_text_len: int | None = None  # output text is cut here when a stop string matched
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # params.prompt_logprobs: entry i is prompt token i's (entry 0, with nothing before it, None)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=lambda: [None])
    forks: tuple[Fork, ...] = ()  # spawned when the prompt is computed, before the first sample
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = str(self.seq_id)
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
