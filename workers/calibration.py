"""Measures what one engine replica can do, for the planner's capacity model: prefill
tokens/s, and decode step time as a function of batch size (base + per-sequence)."""

from __future__ import annotations

import time

import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def _run(engine: LLMEngine, ids: list[str]) -> None:
    pending = set(ids)
    while pending:
        for output in engine.step().finished:
            pending.discard(output.request_id)


def measure_capacity(
    engine: LLMEngine, prompt_len: int = 256, batch: int = 16, steps: int = 8
) -> dict[str, float]:
    """Run synthetic requests on ``engine`` (the caller holds it exclusively) and return
    ``prefill_tokens_per_s``, ``decode_step_s_base``, ``decode_step_s_per_seq``.

    Random token ids, so no prefix-cache hit flatters prefill; every block is freed after."""
    generator = torch.Generator().manual_seed(0)
    vocab = min(engine.model_config.vocab_size, 250)
    prompt_len = min(prompt_len, engine.max_model_len - steps - 2)
    batch = max(2, min(batch, engine.config.max_num_seqs))

    def prompts(n: int, length: int) -> list[list[int]]:
        return torch.randint(3, vocab, (n, length), generator=generator).tolist()

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ids = [
        engine.add_request(p, one, request_id=f"calibrate-prefill-{i}").request_id
        for i, p in enumerate(prompts(2, prompt_len))
    ]
    start = time.perf_counter()
    _run(engine, ids)
    prefill_tokens_per_s = 2 * prompt_len / max(time.perf_counter() - start, 1e-9)

    def decode_step_time(n: int) -> float:
        params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
        rids = [
            engine.add_request(p, params, request_id=f"calibrate-decode-{n}-{i}").request_id
            for i, p in enumerate(prompts(n, 16))
        ]
        engine.step()  # the prefill of all n
        start = time.perf_counter()
        for _ in range(steps - 1):
            engine.step()
        elapsed = (time.perf_counter() - start) / (steps - 1)
        _run(engine, rids)
        return elapsed

    small, large = decode_step_time(1), decode_step_time(batch)
    per_seq = max((large - small) / (batch - 1), 0.0)
    return {
        "prefill_tokens_per_s": prefill_tokens_per_s,
        "decode_step_s_base": max(small - per_seq, 1e-6),
        "decode_step_s_per_seq": per_seq,
    }
