"""``pdcluster bench host-tier``: a working set of shared prefixes twice the engine's KV cache,
served by one engine without a host KV tier and by one with a host tier as big as its device
cache, same model, same prompts, same run.

``--documents`` documents (8) of ``--doc-blocks`` full blocks each (a quarter of the device
cache's ``--device-blocks``) are each asked ``--questions`` questions (4), round-robin
(every document's first question, then every document's second, ...), one request at a time.
The documents alone are twice the cache, so by the time a document comes round again an LRU
device cache has evicted it: without a tier each round recomputes everything; with one, the
evicted blocks wait in host memory and come back by copy.

Per engine it prints the prompt tokens served from the device cache and from the host tier,
those computed, the share of the ideal served (the ideal: each prompt finding the longest
prefix it shares with any prompt before it, in whole blocks, never its last token's), and the
prompt phase's time (the steps' wall time; ``--max-tokens`` 1: prefill steps only). The bar
(the issue's): with the tier, at least 70% of the ideal from the two tiers.
"""

from __future__ import annotations

import json

import torch

from engine.checkpoint import Checkpoint
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.named_models import DEFAULT_MODEL
from engine.prefix_hash import block_hashes
from engine.sampling_params import SamplingParams

BAR = 0.70  # of the ideal prefix tokens served from the two tiers, with the tier


def working_set(
    vocab: int, documents: int, doc_tokens: int, questions: int, question_len: int, seed: int
) -> list[list[int]]:
    """The prompts in the order they are sent: question q of every document, q = 0, 1, ..."""
    generator = torch.Generator().manual_seed(seed)
    low, high = min(100, vocab // 4), vocab - 1

    def draw(n: int) -> list[int]:
        return torch.randint(low, high, (n,), generator=generator).tolist()

    docs = [draw(doc_tokens) for _ in range(documents)]
    asked = [[draw(question_len) for _ in range(questions)] for _ in range(documents)]
    return [docs[d] + asked[d][q] for q in range(questions) for d in range(documents)]


def ideal_prefix_tokens(prompts: list[list[int]], block_size: int) -> int:
    """Tokens each prompt could be served from a cache of everything sent before it."""
    seen: set[int] = set()
    total = 0
    for prompt in prompts:
        hashes = block_hashes(prompt, block_size, len(prompt) - 1)  # never the last token's
        for block_hash in hashes:
            if block_hash not in seen:
                break
            total += block_size
        seen.update(hashes)
    return total


def run_engine(
    model: str,
    config: EngineConfig,
    prompts: list[list[int]],
    warm_up: list[list[int]],
    params: SamplingParams,
) -> dict:
    engine = LLMEngine(model, config, progress=False)
    try:
        for prompt in warm_up:  # first-step costs (allocations, plans) out of the measurement
            _serve(engine, prompt, params)
        bm = engine.block_manager
        before = (bm.prefix_hit_tokens, bm.host_hit_tokens, engine.num_prompt_tokens_computed)
        load_before = engine.tier_load()
        seconds = 0.0
        for prompt in prompts:
            seconds += _serve(engine, prompt, params)
        hits = bm.prefix_hit_tokens - before[0]
        host = bm.host_hit_tokens - before[1]
        load = engine.tier_load()
        stats = engine.host_tier.stats() if engine.host_tier is not None else None
        return {
            "device_blocks": bm.num_blocks,
            "host_blocks": load["host_blocks"],
            "prompt_tokens": sum(len(p) for p in prompts),
            "device_hit_tokens": hits - host,
            "host_hit_tokens": host,
            "computed_tokens": engine.num_prompt_tokens_computed - before[2],
            "prefill_s": seconds,
            "host_offloads": load["host_offloads"] - load_before["host_offloads"],
            "host_loads": load["host_loads"] - load_before["host_loads"],
            "offload_us_per_block": _us(stats.offload_s_per_block) if stats else None,
            "load_us_per_block": _us(stats.load_s_per_block) if stats else None,
            "bytes_per_block": engine.cache.bytes_per_block(),
            "kv_cache_dtype": str(engine.cache.dtype),
        }
    finally:
        engine.close()


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


def _serve(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> float:
    """One request to its end; the seconds its steps took."""
    seq = engine.add_request(prompt, params)
    seconds = 0.0
    while engine.has_request(seq.request_id):
        seconds += engine.step().seconds
    return seconds


def add_host_tier_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "host-tier",
        help="shared prefixes twice the KV cache: without and with a host KV tier",
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--device-blocks", type=int, default=64, help="the device cache's blocks")
    p.add_argument(
        "--host-blocks", type=int, default=None, help="the host tier's (default: as many)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--documents", type=int, default=8)
    p.add_argument(
        "--doc-blocks", type=int, default=None, help="full blocks per document (default N/4)"
    )
    p.add_argument("--questions", type=int, default=4, help="per document, round-robin")
    p.add_argument("--question-len", type=int, default=12, help="tokens (under one block)")
    p.add_argument("--max-tokens", type=int, default=1, help="per request (1: prefill only)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=run_host_tier_cli)


def run_host_tier_cli(args) -> int:
    doc_blocks = args.doc_blocks or max(1, args.device_blocks // 4)
    if args.question_len >= args.block_size:
        raise SystemExit("--question-len: under one block, so only documents fill blocks")
    host_blocks = args.host_blocks or args.device_blocks
    common = dict(
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        num_kv_blocks=args.device_blocks,
        max_num_seqs=4,
        seed=args.seed,
    )
    vocab = Checkpoint(args.model).config.vocab_size
    prompts = working_set(
        vocab,
        args.documents,
        doc_blocks * args.block_size,
        args.questions,
        args.question_len,
        args.seed,
    )
    warm_up = working_set(vocab, 2, args.block_size * 2, 1, args.question_len, args.seed + 1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ideal = ideal_prefix_tokens(prompts, args.block_size)
    runs = {
        "no tier": run_engine(args.model, EngineConfig(**common), prompts, warm_up, params),
        "host tier": run_engine(
            args.model,
            EngineConfig(**common, num_host_kv_blocks=host_blocks, preemption_mode="auto"),
            prompts,
            warm_up,
            params,
        ),
    }
    for run in runs.values():
        run["of_ideal"] = (run["device_hit_tokens"] + run["host_hit_tokens"]) / ideal
    base, tier = runs["no tier"], runs["host tier"]
    summary = {
        "model": args.model,
        "documents": args.documents,
        "doc_blocks": doc_blocks,
        "questions": args.questions,
        "block_size": args.block_size,
        "working_set_blocks": args.documents * doc_blocks,
        "ideal_prefix_tokens": ideal,
        "runs": runs,
        "prefill_time_ratio": tier["prefill_s"] / base["prefill_s"],
        "bar": BAR,
        "bar_met": tier["of_ideal"] >= BAR,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"{args.model}: {args.documents} documents x {doc_blocks} blocks of {args.block_size} "
        f"tokens ({args.documents * doc_blocks} blocks) against a {args.device_blocks}-block "
        f"cache, {args.questions} questions each, round-robin, one request at a time; "
        f"{tier['kv_cache_dtype']} KV, {tier['bytes_per_block'] / 1024:.0f} KiB a block"
    )
    print(f"ideal prefix tokens (shared with an earlier prompt, whole blocks): {ideal}")
    header = (
        f"{'engine':>10} {'host blks':>9} {'prompt tok':>10} {'device hit':>10} "
        f"{'host hit':>9} {'computed':>9} {'of ideal':>8} {'prefill s':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, run in runs.items():
        print(
            f"{name:>10} {run['host_blocks']:>9} {run['prompt_tokens']:>10} "
            f"{run['device_hit_tokens']:>10} {run['host_hit_tokens']:>9} "
            f"{run['computed_tokens']:>9} {run['of_ideal']:>8.1%} {run['prefill_s']:>9.2f}"
        )
    if tier["offload_us_per_block"] is not None:
        load_us = tier["load_us_per_block"]
        print(
            f"host tier: {tier['host_offloads']} blocks offloaded, {tier['host_loads']} loaded; "
            f"{tier['offload_us_per_block']:.0f} us a block out, "
            + (f"{load_us:.0f} us in" if load_us is not None else "none in")
        )
    print(
        f"prefill time with the tier: {summary['prefill_time_ratio']:.2f}x without; "
        f"prefix tokens served: {tier['of_ideal']:.1%} of the ideal against "
        f"{base['of_ideal']:.1%} (bar {BAR:.0%}: {'met' if summary['bar_met'] else 'NOT met'})"
    )
    return 0


def main() -> None:
    """``python -m benchmarks.host_tier_bench [options]``: the same as the CLI's."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_host_tier_parser(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(["host-tier", *sys.argv[1:]])
    raise SystemExit(args.func(args))


if __name__ == "__main__":
    main()
