"""The bare engine's prefill of a 128-token prompt as a serving actor runs it (the served
dtype, one torch thread, no prefix cache): the baseline for `bench serve`'s TTFT.

    python -m benchmarks.bare_prefill [--model smollm2-135m] [--tokens 128] [--dtype auto]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--dtype", default="auto", help="as `pdcluster serve --dtype`")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from engine import LLM, SamplingParams

    llm = LLM(args.model, progress=False, dtype=args.dtype, enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(1)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for _ in range(args.runs + 2):  # the first two warm up
        prompt = [rng.randrange(vocab) for _ in range(args.tokens)]
        started = time.perf_counter()
        llm.generate([prompt], one)
        times.append(time.perf_counter() - started)
    times = times[2:]
    print(
        f"bare prefill, {args.tokens} tokens, {llm.engine.dtype}, 1 thread: median "
        f"{statistics.median(times) * 1e3:.1f} ms (min {min(times) * 1e3:.1f}, max "
        f"{max(times) * 1e3:.1f}) over {len(times)} prompts"
    )


if __name__ == "__main__":
    main()
