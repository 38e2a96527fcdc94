"""How to sample one request's tokens, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.structured_output import GrammarSpec


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. ``seed`` makes a sampled request reproducible on its own,
    whatever else is batched with it. ``logprobs=N`` returns the chosen token's logprob and
    the N most likely tokens' at each step (from the model's unmodified distribution);
    ``prompt_logprobs=N`` the same for every prompt token after the first (such a request
    skips the prefix cache: a cached token's logits are never computed).

    Before sampling (engine/logits_processors.py): ``logit_bias`` ((token id, bias) pairs,
    added to the logits); ``presence_penalty`` and ``frequency_penalty`` (OpenAI's: minus
    presence for a token already in the output, minus frequency per time it is there);
    ``repetition_penalty`` (transformers': a prompt or output token's logit divided by it
    when positive, multiplied when negative); below ``min_tokens``, EOS and stop_token_ids
    cannot be drawn. ``grammar``: only tokens that keep the output matching it are drawn
    (engine/structured_output.py)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 100.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("top_k", self.top_k, minimum=0)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens must not exceed max_tokens")
        if not isinstance(self.temperature, int | float) or isinstance(self.temperature, bool):
            raise InvalidRequestError("temperature must be a number")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0)
                if value > self.MAX_LOGPROBS:
                    raise InvalidRequestError(f"{name} must be at most {self.MAX_LOGPROBS}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids entry", t, minimum=0)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError(
                f"repetition_penalty must be a number in (0, 2], got {self.repetition_penalty!r}"
            )
        bias = self.logit_bias
        pairs = tuple(bias.items()) if isinstance(bias, dict) else tuple(bias)
        for pair in pairs:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise InvalidRequestError("logit_bias must map token ids to numbers")
            t, b = pair
            _check_int("logit_bias token id", t, minimum=0)
            if not _is_number(b) or not -self.MAX_LOGIT_BIAS <= b <= self.MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}"
                )
        if len({t for t, _ in pairs}) != len(pairs):
            raise InvalidRequestError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in pairs)))
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise InvalidRequestError("grammar must be a GrammarSpec")

    @property
    def needs_logits_processing(self) -> bool:
        """Whether the logits change before every sample (besides temperature, top-k,
        top-p); min_tokens changes them only until that many tokens are out."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {value}")
