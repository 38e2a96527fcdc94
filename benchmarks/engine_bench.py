"""``pdcluster bench engine``: decode ms/step at several batch sizes and prefill tokens/s at
several prompt lengths, each next to transformers on the same weights and dtype in the same
run (``generate`` batched at the same concurrency; one forward for prefill), and next to this
machine's bounds measured in the same run (weights read at the measured memory bandwidth for
decode, the model's own GEMMs at the measured matmul throughput for prefill).

Prompts are random token ids, distinct per measurement, so no prefix-cache hit flatters
prefill. Decode time is a generation's time minus its prefill's, over the steps after the
first token.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.roofline import (
    best_of,
    gemm_tflops,
    prefill_flops,
    read_bandwidth_gbs,
    weight_bytes,
)
from engine import LLM, SamplingParams
from engine.checkpoint import local_path
from engine.tiny import TINY_NAME, save_tiny_checkpoint


def add_engine_bench_parser(benches, default_model: str, model_help: str) -> None:
    p = benches.add_parser(
        "engine", help="decode ms/step and prefill tokens/s vs transformers and the roofline"
    )
    p.add_argument("--model", default=default_model, help=model_help)
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU), float32, bfloat16")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--concurrency", default="1,8,32", help="decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length of decode runs")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated in decode runs")
    p.add_argument(
        "--prefill", default="1x256,1x1676,1x4096,32x256", help="prefill shapes, COUNTxLENGTH"
    )
    p.add_argument("--no-baseline", action="store_true", help="skip transformers")
    p.add_argument("--json-out", default=None, help="also write the results as JSON here")
    p.set_defaults(func=run_engine_benchmark)


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    low = min(100, vocab // 4)
    return torch.randint(low, vocab, (count, length), generator=generator).tolist()


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class EngineRunner:
    """Our engine, measured."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.vocab = llm.engine.model_config.vocab_size
        self._seed = 0

    def fresh(self, count: int, length: int) -> list[list[int]]:
        self._seed += 1
        return _prompts(count, length, self.vocab, self._seed)

    def prefill_s(self, count: int, length: int) -> float:
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        return _time(lambda: self.llm.generate(self.fresh(count, length), one))

    def decode_step_s(self, count: int, length: int, new_tokens: int) -> float:
        full = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        prefill = self.prefill_s(count, length)
        total = _time(lambda: self.llm.generate(self.fresh(count, length), full))
        return max(total - prefill, 1e-9) / (new_tokens - 1)


class TransformersRunner:
    """transformers on the same weights and dtype: batched ``generate`` (what its users run
    offline), one forward (``logits_to_keep=1``, as generate's prefill) for prefill."""

    def __init__(self, model_source: str, dtype: torch.dtype, vocab: int) -> None:
        from transformers import AutoModelForCausalLM

        self._tmp = None
        if model_source == TINY_NAME:
            self._tmp = tempfile.TemporaryDirectory()
            save_tiny_checkpoint(self._tmp.name)
            path = Path(self._tmp.name)
        else:
            path = local_path(model_source)
        kwargs = {"gguf_file": path.name} if path.is_file() else {}
        folder = path.parent if path.is_file() else path
        # Loaded in fp32, then cast: transformers keeps a GGUF's blocks packed (its own
        # dequantising kernels) when asked for another dtype, which is not the baseline.
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
        self.model = model.to(dtype).eval()
        self.vocab = vocab
        self._seed = 10_000

    def fresh(self, count: int, length: int) -> torch.Tensor:
        self._seed += 1
        return torch.tensor(_prompts(count, length, self.vocab, self._seed))

    @torch.inference_mode()
    def prefill_s(self, count: int, length: int) -> float:
        ids = self.fresh(count, length)
        return best_of(lambda: self.model(ids, use_cache=False, logits_to_keep=1), repeats=1)

    @torch.inference_mode()
    def decode_step_s(self, count: int, length: int, new_tokens: int) -> float:
        ids = self.fresh(count, length)

        def generate() -> None:
            self.model.generate(
                ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

        prefill = best_of(lambda: self.model(ids, use_cache=True, logits_to_keep=1), repeats=1)
        total = best_of(generate, repeats=1)
        return max(total - prefill, 1e-9) / (new_tokens - 1)


def _shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        count, _, length = item.partition("x")
        shapes.append((int(count), int(length)))
    return shapes


def _blocks_needed(args, concurrencies, prefill_shapes, block_size: int = 16) -> int:
    decode = [c * (args.prompt_len + args.output_len) for c in concurrencies]
    prefill = [count * length for count, length in prefill_shapes]
    return max(decode + prefill) // block_size + 64


def run_engine_benchmark(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    prefill_shapes = _shapes(args.prefill)
    longest = max(length for _, length in prefill_shapes)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        progress=False,
        max_num_seqs=max(concurrencies + [c for c, _ in prefill_shapes]),
        max_num_batched_tokens=max(8192, longest),
        num_kv_blocks=_blocks_needed(args, concurrencies, prefill_shapes),
    )
    engine = llm.engine
    config = engine.model_config
    dtype = engine.dtype
    print(
        f"model={args.model} device={engine.device} dtype={dtype} kv={engine.cache.dtype} "
        f"torch_threads={torch.get_num_threads()}",
        flush=True,
    )
    ours = EngineRunner(llm)
    ours.decode_step_s(1, 16, 4)  # warm-up
    theirs = None
    if not args.no_baseline and engine.device.type == "cpu":
        theirs = TransformersRunner(args.model, dtype, config.vocab_size)

    bandwidth = read_bandwidth_gbs()
    weights = weight_bytes(engine.model)
    bound_s = weights / (bandwidth * 1e9)
    print(
        f"bounds (same run): memory read {bandwidth:.1f} GB/s -> weights "
        f"{weights / 1e6:.0f} MB read in {bound_s * 1e3:.1f} ms per decode step",
        flush=True,
    )

    decode = []
    print(f"decode: prompt {args.prompt_len}, {args.output_len} new tokens")
    print(
        f"{'batch':>6} {'ms/step':>9} {'tok/s':>8} {'HF ms/step':>11} {'vs HF':>7} {'vs bound':>9}"
    )
    for count in concurrencies:
        step = ours.decode_step_s(count, args.prompt_len, args.output_len)
        row = {"batch": count, "ms_per_step": step * 1e3, "tok_s": count / step}
        row["bound_ms"] = bound_s * 1e3
        if theirs is not None:
            row["hf_ms_per_step"] = (
                theirs.decode_step_s(count, args.prompt_len, args.output_len) * 1e3
            )
        decode.append(row)
        hf = row.get("hf_ms_per_step")
        print(
            f"{count:>6} {row['ms_per_step']:>9.1f} {row['tok_s']:>8.0f} "
            + (f"{hf:>11.1f} {hf / row['ms_per_step']:>6.2f}x " if hf else f"{'-':>11} {'-':>7} ")
            + f"{row['ms_per_step'] / row['bound_ms']:>8.2f}x",
            flush=True,
        )

    prefill = []
    print("prefill: distinct prompts, one step each")
    print(
        f"{'shape':>8} {'ms':>9} {'tok/s':>8} {'HF ms':>9} {'vs HF':>7} "
        f"{'GEMM TFLOP/s':>13} {'of GEMM':>8}"
    )
    for count, length in prefill_shapes:
        seconds = ours.prefill_s(count, length)
        tokens = count * length
        peak = gemm_tflops(config, tokens, dtype)
        achieved = prefill_flops(config, [length] * count) / seconds / 1e12
        row = {
            "shape": f"{count}x{length}",
            "ms": seconds * 1e3,
            "tok_s": tokens / seconds,
            "tflops": achieved,
            "gemm_tflops": peak,
        }
        if theirs is not None:
            row["hf_ms"] = theirs.prefill_s(count, length) * 1e3
        prefill.append(row)
        hf = row.get("hf_ms")
        print(
            f"{row['shape']:>8} {row['ms']:>9.0f} {row['tok_s']:>8.0f} "
            + (f"{hf:>9.0f} {hf / row['ms']:>6.2f}x " if hf else f"{'-':>9} {'-':>7} ")
            + f"{peak:>13.3f} {achieved / peak:>7.0%}",
            flush=True,
        )
    print(
        "vs HF: transformers' time / ours (>1 = we are faster); vs bound: our step / the "
        "weight-read time; of GEMM: useful prefill FLOP/s / the model's GEMMs alone"
    )
    if args.json_out:
        result = {
            "model": args.model,
            "dtype": str(dtype),
            "threads": torch.get_num_threads(),
            "read_gbs": bandwidth,
            "weight_bytes": weights,
            "decode": decode,
            "prefill": prefill,
        }
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0
