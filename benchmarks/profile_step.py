"""Where one engine step's time goes: the torch profiler's table for a decode step (or a
prefill step) of a real model, host-side Python included.

    python -m benchmarks.profile_step --model smollm2-135m --batch 32 --context 128
    python -m benchmarks.profile_step --prefill 1676
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from engine.named_models import DEFAULT_MODEL


def step_llm(
    model: str, dtype: str, *, prefill: int, batch: int, context: int, steps: int, **options
) -> LLM:
    """An engine sized for one step of interest: a prompt of ``prefill`` tokens in one step,
    or ``batch`` sequences of ``context`` tokens decoding for ``steps`` steps (and a few more:
    the steps before the timed ones), with room for either in its cache. ``options``: other LLM
    arguments."""
    kv_tokens = max(prefill, batch * (context + steps + 4))
    return LLM(
        model,
        dtype=dtype,
        progress=False,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(8192, prefill),
        num_kv_blocks=kv_tokens // 16 + 64,
        **options,
    )


def random_prompts(engine: LLMEngine, seed: int = 0):
    """prompt(length): distinct random token ids (no prefix-cache hits), the same for a seed."""
    vocab = engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    return lambda length: torch.randint(100, vocab, (length,), generator=generator).tolist()


def start_decoding(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> None:
    """Add the prompts and step until every one is computed: the next step decodes them all."""
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.waiting):
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32, help="sequences decoding")
    parser.add_argument("--context", type=int, default=128, help="tokens of history each")
    parser.add_argument("--prefill", type=int, default=0, help="profile one prompt this long")
    parser.add_argument("--steps", type=int, default=5, help="steps profiled")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--cpu-gemm", default="auto")
    args = parser.parse_args()
    llm = step_llm(
        args.model,
        args.dtype,
        prefill=args.prefill,
        batch=args.batch,
        context=args.context,
        steps=args.steps,
        cpu_gemm=args.cpu_gemm,
    )
    engine = llm.engine
    prompt = random_prompts(engine)
    if args.prefill:
        engine.add_request(prompt(args.prefill), SamplingParams(max_tokens=1, ignore_eos=True))
        steps = 1
    else:
        params = SamplingParams(max_tokens=args.steps + 2, temperature=0, ignore_eos=True)
        start_decoding(engine, [prompt(args.context) for _ in range(args.batch)], params)
        engine.step()
        steps = args.steps
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    elapsed = (time.perf_counter() - start) / steps
    print(
        f"{args.model} {engine.dtype} threads={torch.get_num_threads()} "
        + (
            f"prefill {args.prefill}"
            if args.prefill
            else f"decode batch {args.batch}, context {args.context}"
        )
        + f": {elapsed * 1e3:.1f} ms per step (under the profiler)"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
