"""What this replica's engine steps cost, measured on its own recent steps: the capacity
model SLO-aware admission (router) and the planner (cluster) both read.

- ``per_token_s``: seconds per prompt token, over the recent steps that computed prompt
  tokens (their whole time: the fixed cost of a step is spread over the tokens it carried,
  and on a colocated replica the decode rows riding along are counted too — the rate a
  prompt backlog actually drains at).
- ``base_s`` + ``per_seq_s`` · batch: a decode-only step, least squares over the recent ones.
  Only steps of different batch sizes say anything of the slope, so it is pulled toward the
  prior's (the start-up calibration when there was one, else flat) as strongly as a few
  steps would.

Callers: the serving loop records every step (its thread, the engine lock held); the
worker's ``stats()`` reports ``estimate()``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepCost:
    base_s: float  # a decode step's fixed cost
    per_seq_s: float  # and its cost per sequence
    per_token_s: float  # a prompt token, steps' overheads included (0: none seen)
    decode_steps: int = 0  # steps the decode terms were fitted on
    prompt_tokens: int = 0  # prompt tokens the prompt term was measured on

    def decode_step_s(self, batch: int) -> float:
        return self.base_s + self.per_seq_s * batch

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return 1.0 / self.per_token_s if self.per_token_s > 0 else None

    def free_batch(self, slack: float = 1.25, limit: int = 1024) -> int:
        """The largest decode batch whose step costs at most ``slack`` x a batch of one:
        below it batching is nearly free, so serving fewer would not make steps faster."""
        if self.per_seq_s <= 0:
            return limit
        one = self.decode_step_s(1)
        return max(1, min(limit, int((slack * one - self.base_s) / self.per_seq_s)))

    @classmethod
    def from_calibration(cls, capacity: dict) -> StepCost:
        """From ``workers.calibration.measure_capacity``'s result."""
        return cls(
            base_s=capacity["decode_step_s_base"],
            per_seq_s=capacity["decode_step_s_per_seq"],
            per_token_s=1.0 / capacity["prefill_tokens_per_s"],
        )


class StepCostModel:
    def __init__(
        self,
        prior: StepCost | None = None,
        decode_window: int = 256,
        prompt_window: int = 32,
        prior_weight: float = 3.0,
    ) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self._decode: deque[tuple[int, float]] = deque(maxlen=decode_window)  # (batch, s)
        self._prompt: deque[tuple[int, float]] = deque(maxlen=prompt_window)  # (tokens, s)

    def record(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens:
            self._prompt.append((prompt_tokens, seconds))
        elif decode_rows:
            self._decode.append((decode_rows, seconds))

    def estimate(self) -> StepCost | None:
        """The measured cost (prior where unmeasured), or None with neither."""
        prior = self.prior
        if not self._decode and not self._prompt:
            return prior
        tokens = sum(n for n, _ in self._prompt)
        if tokens:
            per_token = sum(s for _, s in self._prompt) / tokens
        else:
            per_token = prior.per_token_s if prior else 0.0
        base, per_seq = self._fit_decode()
        return StepCost(base, per_seq, per_token, len(self._decode), tokens)

    def _fit_decode(self) -> tuple[float, float]:
        """Least squares of seconds on batch size. The level at the mean batch is what the
        steps say; the slope is pinned only by steps of different sizes, and pulled toward
        the prior's (flat without one) as if ``prior_weight`` steps one batch apart agreed."""
        prior = self.prior
        if not self._decode:
            return (prior.base_s, prior.per_seq_s) if prior else (0.0, 0.0)
        data = np.array(self._decode, dtype=np.float64)
        batch, seconds = data[:, 0], data[:, 1]
        centred = batch - batch.mean()
        slope0 = prior.per_seq_s if prior else 0.0
        slope = (centred @ (seconds - seconds.mean()) + self.prior_weight * slope0) / (
            centred @ centred + self.prior_weight
        )
        base = seconds.mean() - slope * batch.mean()
        return max(0.0, float(base)), max(0.0, float(slope))
