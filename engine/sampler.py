"""Turns the last-position logits of a batch into next tokens (greedy, temperature, top-k,
top-p), with per-request seeded generators so a seeded request samples the same tokens
whatever else shares its batch."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs


class Sampler:
    def __init__(self, seed: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._default_generator = torch.Generator().manual_seed(seed)
        self._generators: dict[int, torch.Generator] = {}  # seq_id → its own, when seeded

    def skip_first_draw(self, seq_id: int, params: SamplingParams) -> None:
        """The first token was sampled elsewhere (a prefill worker, same seed): advance this
        sequence's generator past it, so the rest matches a single-engine run."""
        if params.seed is not None and not params.greedy:
            self._exponential(seq_id, params, self.vocab_size)

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [n, V] fp32 (any device) → n token ids and, where asked, their logprobs."""
        logits = logits.float().cpu()
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            probs = _filtered_probs(logits[rows], [params[i] for i in sampled_rows])
            noise = torch.stack(
                [self._exponential(seq_ids[i], params[i], probs.shape[-1]) for i in sampled_rows]
            )
            # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race).
            tokens[rows] = (probs / noise).argmax(dim=-1)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            log_probs = torch.log_softmax(logits[wanted], dim=-1)
            for row, i in enumerate(wanted):
                top = torch.topk(log_probs[row], params[i].logprobs) if params[i].logprobs else None
                logprobs[i] = TokenLogprobs(
                    token_id=token_list[i],
                    logprob=log_probs[row, token_list[i]].item(),
                    top={}
                    if top is None
                    else dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)),
                )
        return token_list, logprobs

    def _exponential(self, seq_id: int, params: SamplingParams, vocab: int) -> torch.Tensor:
        generator = self._default_generator
        if params.seed is not None:
            generator = self._generators.get(seq_id)
            if generator is None:
                generator = self._generators[seq_id] = torch.Generator().manual_seed(params.seed)
        return torch.empty(vocab).exponential_(generator=generator)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) over [n, V] logits → probabilities."""
    temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    logits = logits / temperature
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab).unsqueeze(0)
        k = torch.tensor([k if k > 0 else vocab for k in top_k]).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = torch.tensor(top_p).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits.softmax(dim=-1)
