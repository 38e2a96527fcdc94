"""Turns the last-position logits of a batch into next tokens (the request's logits
processors, then greedy or temperature, top-k, top-p), with per-request seeded generators so
a seeded request samples the same tokens whatever else shares its batch."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from engine.logits_processors import process_logits
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, TokenLogprobs
from engine.structured_output import GrammarMasks


class Sampler:
    """Samples on the logits' device: only the chosen tokens (and asked-for logprobs) come
    back to the host, not the [n, vocab] logits. A seeded request draws its noise from its
    own generator on that device, so prefill and decode workers on the same kind of device
    continue one stream."""

    def __init__(self, seed: int, vocab_size: int, tokenizer: Any = None) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()
        self._grammars: GrammarMasks | None = None  # made when a request first has a grammar
        self.seed = seed
        self._default_generators: dict[str, torch.Generator] = {}  # device → unseeded stream
        self._generators: dict[int, torch.Generator] = {}  # seq_id → its own, when seeded

    def skip_first_draw(
        self, seq_id: int, params: SamplingParams, device: torch.device | str = "cpu"
    ) -> None:
        """The first token was sampled elsewhere (a prefill worker, same seed): advance this
        sequence's generator past it, so the rest matches a single-engine run."""
        if params.seed is not None and not params.greedy:
            self._exponential(seq_id, params, self.vocab_size, torch.device(device))

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
        if self._grammars is not None:
            self._grammars.forget(seq_id)

    def accept(self, seq: Sequence, token: int) -> None:
        """``seq`` took ``token`` (sampled here or on a prefill worker): its grammar moves on."""
        if seq.params.grammar is not None:
            self.grammar_masks().accept(seq.seq_id, seq.params.grammar, token)

    def grammar_masks(self) -> GrammarMasks:
        if self._grammars is None:
            self._grammars = GrammarMasks(self.tokenizer, self.vocab_size)
        return self._grammars

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, seqs: Seq[Sequence]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [n, V] (any device) of ``seqs``' next tokens → n token ids and, where
        asked, their logprobs (of the unprocessed logits)."""
        device = logits.device
        logits = logits.float()
        seq_ids = [s.seq_id for s in seqs]
        params = [s.params for s in seqs]
        processed = process_logits(logits, seqs, self.eos_token_ids)
        if any(p.grammar is not None for p in params):
            processed = processed.clone() if processed is logits else processed
            self.grammar_masks().mask(processed, seq_ids, [p.grammar for p in params])
        # max's indices: the same first maximum as argmax, at ~2.5x its speed on CPU (measured:
        # 0.46 against 1.16 ms for [32, 49152] fp32, 2 threads).
        tokens = processed.max(dim=-1).indices
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=device)
            probs = _filtered_probs(processed[rows], [params[i] for i in sampled_rows])
            noise = torch.stack(
                [
                    self._exponential(seq_ids[i], params[i], probs.shape[-1], device)
                    for i in sampled_rows
                ]
            )
            # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race).
            tokens[rows] = (probs / noise).argmax(dim=-1)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            index = torch.tensor(wanted, device=device)
            entries = token_logprobs(
                logits[index], tokens[index], [params[i].logprobs for i in wanted]
            )
            for i, entry in zip(wanted, entries, strict=True):
                logprobs[i] = entry
        return token_list, logprobs

    def _exponential(
        self, seq_id: int, params: SamplingParams, vocab: int, device: torch.device
    ) -> torch.Tensor:
        if params.seed is not None:
            generator = self._generators.get(seq_id)
            if generator is None:
                generator = torch.Generator(device=device).manual_seed(params.seed)
                self._generators[seq_id] = generator
        else:
            generator = self._default_generators.get(device.type)
            if generator is None:
                generator = torch.Generator(device=device).manual_seed(self.seed)
                self._default_generators[device.type] = generator
        return torch.empty(vocab, device=device).exponential_(generator=generator)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, ks: list[int]
) -> list[TokenLogprobs]:
    """logits [m, V] and the m tokens that followed them → each token's logprob and the
    ``ks[i]`` most likely tokens' (of the unprocessed distribution)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [m, V]
    chosen = log_probs.gather(1, tokens[:, None])[:, 0].tolist()
    k = max(ks)
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    if k:
        top = torch.topk(log_probs, k)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprobs(
            token_id=token,
            logprob=chosen[row],
            top=dict(zip(top_ids[row][:n], top_values[row][:n], strict=True)) if n else {},
        )
        for row, (token, n) in enumerate(zip(tokens.tolist(), ks, strict=True))
    ]


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) over [n, V] logits → probabilities."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temperature
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = torch.tensor(top_p, device=device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits.softmax(dim=-1)
