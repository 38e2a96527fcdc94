"""What a request's sampling options do to its logits before a token is drawn: logit_bias,
presence/frequency penalties (OpenAI's), repetition penalty (transformers'), min_tokens.

Batched on the logits' device: one scatter per option over the rows that ask for it, so a
batch where nobody asks costs nothing. The inputs are only the request's own tokens, so the
first token (sampled on a prefill worker, history = the prompt) and the rest (on a decode
worker, history = prompt + output) see the same processing as a single engine would.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine.sequence import Sequence


def process_logits(
    logits: torch.Tensor, seqs: Seq[Sequence], eos_token_ids: Seq[int]
) -> torch.Tensor:
    """logits [n, V] float32 of ``seqs``' next tokens → the logits each row samples from (a
    new tensor when any row asks for processing; ``logits`` itself otherwise)."""
    rows = [i for i, s in enumerate(seqs) if _asks(s)]
    if not rows:
        return logits
    logits = logits.clone()
    device = logits.device
    chosen = [(i, seqs[i].params, seqs[i].prompt_token_ids, seqs[i].output_token_ids) for i in rows]
    _repetition_penalty(logits, device, chosen)
    _output_penalties(logits, device, [(i, p, out) for i, p, _, out in chosen])
    _logit_bias(logits, device, [(i, p) for i, p, _, _ in chosen])
    _min_tokens(logits, device, [(i, p, len(out)) for i, p, _, out in chosen], eos_token_ids)
    return logits


def _asks(seq: Sequence) -> bool:
    """Whether this step changes the row's logits: min_tokens only until that many are out
    (a request with min_tokens must not cost a logits copy for the rest of its life)."""
    params = seq.params
    if params.needs_logits_processing:
        return True
    return seq.num_tokens - seq.num_prompt_tokens < params.min_tokens


def _repetition_penalty(logits, device, rows) -> None:
    rows = [(i, p, prompt, out) for i, p, prompt, out in rows if p.repetition_penalty != 1.0]
    if not rows:
        return
    index = torch.tensor([i for i, *_ in rows], device=device)
    seen = (
        _token_counts(
            [list(prompt) + list(out) for _, _, prompt, out in rows], logits.shape[-1], device
        )
        > 0
    )  # [r, V]
    penalty = torch.tensor([p.repetition_penalty for _, p, *_ in rows], device=device)[:, None]
    picked = logits[index]
    penalised = torch.where(picked > 0, picked / penalty, picked * penalty)
    logits[index] = torch.where(seen, penalised, picked)


def _output_penalties(logits, device, rows) -> None:
    rows = [(i, p, out) for i, p, out in rows if p.presence_penalty or p.frequency_penalty]
    if not rows:
        return
    index = torch.tensor([i for i, *_ in rows], device=device)
    counts = _token_counts([out for *_, out in rows], logits.shape[-1], device)  # [r, V]
    frequency = torch.tensor([p.frequency_penalty for _, p, _ in rows], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for _, p, _ in rows], device=device)[:, None]
    logits[index] -= frequency * counts + presence * (counts > 0)


def _logit_bias(logits, device, rows) -> None:
    pairs = [(i, t, b) for i, p in rows for t, b in p.logit_bias]
    if not pairs:
        return
    r, t, b = zip(*pairs, strict=True)
    logits.index_put_(
        (torch.tensor(r, device=device), torch.tensor(t, device=device)),
        torch.tensor(b, device=device, dtype=logits.dtype),
        accumulate=True,
    )


def _min_tokens(logits, device, rows, eos_token_ids) -> None:
    """Below min_tokens nothing that would stop the request may be drawn: its stop token ids,
    and EOS unless it ignores EOS."""
    pairs = []
    for i, p, num_output in rows:
        if num_output >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        pairs += [(i, t) for t in banned if t < logits.shape[-1]]
    if pairs:
        r, t = zip(*pairs, strict=True)
        logits[torch.tensor(r, device=device), torch.tensor(t, device=device)] = float("-inf")


def _token_counts(histories: list[Seq[int]], vocab: int, device) -> torch.Tensor:
    """[r, V] float: how many times each token occurs in each row's history."""
    width = max(1, max(len(h) for h in histories))
    ids = torch.full((len(histories), width), vocab, dtype=torch.long)  # vocab = padding
    for row, history in enumerate(histories):
        if history:
            ids[row, : len(history)] = torch.as_tensor(list(history), dtype=torch.long)
    counts = torch.zeros(len(histories), vocab + 1, device=device)
    counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    return counts[:, :vocab]
