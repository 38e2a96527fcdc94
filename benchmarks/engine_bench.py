"""``pdcluster bench engine``: prefill and decode tokens/s at several concurrencies, next to
transformers' ``generate`` on the same weights in the same run.

Prefill throughput is measured with one-token requests (time to first token of the whole
batch); decode throughput is the rest of the run's tokens over the rest of its time.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.tiny import TINY_NAME, save_tiny_checkpoint


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Random ids (no shared prefixes, so the prefix cache does not flatter prefill).
    return torch.randint(3, min(vocab, 256), (count, length), generator=generator).tolist()


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_engine(
    llm: LLM, concurrency: int, prompt_len: int, output_len: int, vocab: int
) -> dict:
    prompts = _prompts(concurrency, prompt_len, vocab, seed=concurrency)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    full = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(
        prompts[:1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    )  # warm-up
    prefill_s = _time(lambda: llm.generate(prompts, one))
    # Fresh prompts so the decode run's prefill is not served from the prefix cache.
    prompts = _prompts(concurrency, prompt_len, vocab, seed=1000 + concurrency)
    total_s = _time(lambda: llm.generate(prompts, full))
    decode_s = max(total_s - prefill_s, 1e-9)
    return {
        "concurrency": concurrency,
        "prefill_tok_s": concurrency * prompt_len / prefill_s,
        "decode_tok_s": concurrency * (output_len - 1) / decode_s,
        "total_s": total_s,
    }


def measure_transformers(
    model_dir: Path, prompt_len: int, output_len: int, vocab: int, repeats: int
) -> dict:
    """transformers' generate, one request at a time (its usual offline use)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _prompts(repeats, prompt_len, vocab, seed=7)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:1]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        prefill_s = sum(_time(lambda p=p: model(torch.tensor([p]))) for p in prompts)
        total_s = sum(
            _time(
                lambda p=p: model.generate(
                    torch.tensor([p]),
                    max_new_tokens=output_len,
                    min_new_tokens=output_len,
                    do_sample=False,
                    pad_token_id=0,
                )
            )
            for p in prompts
        )
    decode_s = max(total_s - prefill_s, 1e-9)
    return {
        "prefill_tok_s": repeats * prompt_len / prefill_s,
        "decode_tok_s": repeats * (output_len - 1) / decode_s,
    }


def run_engine_benchmark(args) -> int:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        progress=False,
        max_num_seqs=max(concurrencies),
        max_num_batched_tokens=4096,
    )
    vocab = llm.engine.model_config.vocab_size
    device = llm.engine.device
    print(
        f"model={args.model} device={device} dtype={llm.engine.dtype} kv={llm.engine.cache.dtype} "
        f"prompt_len={args.prompt_len} output_len={args.output_len} torch_threads={torch.get_num_threads()}"
    )
    rows = [measure_engine(llm, c, args.prompt_len, args.output_len, vocab) for c in concurrencies]
    baseline = None
    if not args.no_baseline and device.type == "cpu":
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = Path(args.model) if args.model != TINY_NAME else Path(tmp)
            if args.model == TINY_NAME:
                save_tiny_checkpoint(model_dir)
            baseline = measure_transformers(
                model_dir, args.prompt_len, args.output_len, vocab, repeats=3
            )
    header = f"{'concurrency':>11} {'prefill tok/s':>14} {'decode tok/s':>13}"
    if baseline:
        header += f" {'decode vs HF x1':>16}"
    print(header)
    for row in rows:
        line = (
            f"{row['concurrency']:>11} {row['prefill_tok_s']:>14.0f} {row['decode_tok_s']:>13.0f}"
        )
        if baseline:
            line += f" {row['decode_tok_s'] / baseline['decode_tok_s']:>15.1f}x"
        print(line)
    if baseline:
        print(
            f"{'HF x1':>11} {baseline['prefill_tok_s']:>14.0f} {baseline['decode_tok_s']:>13.0f}"
            "   (transformers generate, one request at a time)"
        )
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"engine": rows, "transformers": baseline}, indent=2)
        )
    return 0
