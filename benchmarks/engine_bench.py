"""``pdcluster bench engine``: decode ms/step at several batch sizes and prefill tokens/s at
several prompt lengths, each next to transformers on the same weights and dtype in the same
run (``generate`` batched at the same concurrency; one forward for prefill), and next to this
machine's bounds measured in the same run (weights read at the measured memory bandwidth for
decode, the model's own GEMMs at the measured matmul throughput for prefill).

Prompts are random token ids, distinct per measurement, so no prefix-cache hit flatters
prefill. Decode time is a generation's time minus its prefill's, over the steps after the
first token. With ``--tensor-parallel-size N`` the same measurements run again on the engine
split over N ranks (the machine's threads shared among them), next to tp 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.roofline import (
    best_of,
    gemm_layer,
    prefill_flops,
    read_bandwidth_gbs,
    weight_bytes,
)
from engine import LLM, SamplingParams


def add_engine_bench_parser(benches, default_model: str, model_help: str) -> None:
    p = benches.add_parser(
        "engine", help="decode ms/step and prefill tokens/s vs transformers and the roofline"
    )
    p.add_argument("--model", default=default_model, help=model_help)
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (on CPU: bf16 where measured faster), float32, bfloat16",
    )
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--concurrency", default="1,8,32", help="decode batch sizes")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length of decode runs")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated in decode runs")
    p.add_argument(
        "--prefill", default="1x256,1x1676,1x4096,32x256", help="prefill shapes, COUNTxLENGTH"
    )
    p.add_argument(
        "--prefill-repeats",
        type=int,
        default=3,
        help="the fastest of this many prefills per shape, each of fresh prompts (both engines)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="also measure the engine split over N ranks (next to tp 1, same run)",
    )
    p.add_argument(
        "--no-gguf-gemm", action="store_true", help="dense GEMMs only (engine.gguf_gemm: false)"
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

    def prefill_s(self, count: int, length: int, repeats: int = 1) -> float:
        """The fastest of ``repeats`` prefills, each of fresh prompts (no prefix-cache hit)."""
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        return min(
            _time(lambda: self.llm.generate(self.fresh(count, length), one)) for _ in range(repeats)
        )

    def decode_step_s(self, count: int, length: int, new_tokens: int) -> float:
        full = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        prefill = self.prefill_s(count, length)
        total = _time(lambda: self.llm.generate(self.fresh(count, length), full))
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


def _engine(args, concurrencies, prefill_shapes, tp: int = 1) -> LLM:
    longest = max(length for _, length in prefill_shapes)
    return LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        progress=False,
        max_num_seqs=max(concurrencies + [c for c, _ in prefill_shapes]),
        max_num_batched_tokens=max(8192, longest),
        num_kv_blocks=_blocks_needed(args, concurrencies, prefill_shapes),
        tensor_parallel_size=tp,
        gguf_gemm=not args.no_gguf_gemm,
    )


def _measure_tp(args, concurrencies, prefill_shapes, decode, prefill) -> None:
    """The same measurements at tp N, added to the tp 1 rows (the threads restored after)."""
    threads = torch.get_num_threads()
    size = args.tensor_parallel_size
    with _engine(args, concurrencies, prefill_shapes, size) as llm:
        ours = EngineRunner(llm)
        ours.decode_step_s(1, 16, 4)  # warm-up
        print(f"tp {size}: {torch.get_num_threads()} torch thread(s) per rank", flush=True)
        for row in decode:
            steps = ours.decode_step_s(row["batch"], args.prompt_len, args.output_len)
            row["tp_ms_per_step"] = steps * 1e3
        for row, (count, length) in zip(prefill, prefill_shapes, strict=True):
            row["tp_ms"] = ours.prefill_s(count, length, args.prefill_repeats) * 1e3
    torch.set_num_threads(threads)


def transformers_baseline(args, concurrencies, prefill_shapes, device: torch.device) -> dict:
    """transformers on the same weights, dtype and threads, in a process of its own (in
    ours, its generate slowed our decode steps by up to 60%: shared allocator and thread
    state); run twice, under glibc's malloc defaults and under the engine's setting
    (engine.host_memory), each number the faster of the two: the kept memory speeds its
    prefill (32 x 256: 2.0 -> 1.7 s) and slows its batched decode (b32: 75 -> 93 ms). On a
    GPU once, on the same device (host malloc does not matter there)."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.transformers_baseline",
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--threads",
        str(torch.get_num_threads()),
        "--concurrency",
        ",".join(map(str, concurrencies)),
        "--prompt-len",
        str(args.prompt_len),
        "--output-len",
        str(args.output_len),
        "--prefill",
        ",".join(f"{c}x{n}" for c, n in prefill_shapes),
        "--prefill-repeats",
        str(args.prefill_repeats),
        "--device",
        str(device),
    ]
    runs = []
    for extra in ([], ["--default-malloc"]) if device.type == "cpu" else ([],):
        done = subprocess.run([*command, *extra], stdout=subprocess.PIPE, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {
        key: [min(pair) for pair in zip(*(run[key] for run in runs), strict=True)]
        for key in ("decode_ms", "prefill_ms")
    }


def run_engine_benchmark(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    prefill_shapes = _shapes(args.prefill)
    llm = _engine(args, concurrencies, prefill_shapes)
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

    bandwidth = read_bandwidth_gbs(device=engine.device)
    weights = weight_bytes(engine.model, engine.gemm_plan)
    bound_s = weights / (bandwidth * 1e9)
    print(
        f"bounds (same run): memory read {bandwidth:.1f} GB/s -> weights "
        f"{weights / 1e6:.0f} MB read in {bound_s * 1e3:.1f} ms per one-token decode step "
        "(as GGUF blocks where the plan runs them); "
        f"CPU GEMM plan {engine.gemm_plan.describe() if engine.gemm_plan else '-'}",
        flush=True,
    )

    decode = [
        {
            "batch": count,
            "ms_per_step": ours.decode_step_s(count, args.prompt_len, args.output_len) * 1e3,
            # the weights this batch size reads (GGUF blocks where the plan runs them)
            "bound_ms": weight_bytes(engine.model, engine.gemm_plan, count) / bandwidth / 1e6,
        }
        for count in concurrencies
    ]
    prefill = []
    for count, length in prefill_shapes:
        # the bound: the faster of torch's GEMM and the engine's measured plan, each timed
        # between our prefills (10 runs a turn), so that the machine's slow and fast
        # minutes reach both sides of the ratio alike
        layers = [
            gemm_layer(config, count * length, dtype, linear, device=engine.device)
            for linear in (torch.nn.functional.linear, engine.model.linear)
        ]
        seconds, gemm_s = float("inf"), [float("inf")] * len(layers)
        for _ in range(args.prefill_repeats):
            seconds = min(seconds, ours.prefill_s(count, length))
            for i, (layer, _) in enumerate(layers):
                gemm_s[i] = min(gemm_s[i], best_of(layer, repeats=10, device=engine.device))
        gemm_flop_s = max(flops / s for (_, flops), s in zip(layers, gemm_s, strict=True))
        prefill.append(
            {
                "shape": f"{count}x{length}",
                "ms": seconds * 1e3,
                "tok_s": count * length / seconds,
                "tflops": prefill_flops(config, [length] * count) / seconds / 1e12,
                "gemm_tflops": gemm_flop_s / 1e12,
            }
        )
    device = engine.device
    llm.close()
    del llm, ours, engine  # free the memory for the next engine
    if args.tensor_parallel_size > 1:
        _measure_tp(args, concurrencies, prefill_shapes, decode, prefill)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the baseline's process needs the memory
    if not args.no_baseline:  # transformers runs in a process of its own
        baseline = transformers_baseline(args, concurrencies, prefill_shapes, device)
        for row, hf in zip(decode, baseline["decode_ms"], strict=True):
            row["hf_ms_per_step"] = hf
        for row, hf in zip(prefill, baseline["prefill_ms"], strict=True):
            row["hf_ms"] = hf

    print(f"decode: prompt {args.prompt_len}, {args.output_len} new tokens")
    print(
        f"{'batch':>6} {'ms/step':>9} {'tok/s':>8} {'HF ms/step':>11} {'vs HF':>7} {'vs bound':>9}"
    )
    for row in decode:
        row["tok_s"] = row["batch"] / row["ms_per_step"] * 1e3
        hf = row.get("hf_ms_per_step")
        print(
            f"{row['batch']:>6} {row['ms_per_step']:>9.1f} {row['tok_s']:>8.0f} "
            + (f"{hf:>11.1f} {hf / row['ms_per_step']:>6.2f}x " if hf else f"{'-':>11} {'-':>7} ")
            + f"{row['ms_per_step'] / row['bound_ms']:>8.2f}x"
        )
    print("prefill: distinct prompts, one step each")
    print(
        f"{'shape':>8} {'ms':>9} {'tok/s':>8} {'HF ms':>9} {'vs HF':>7} "
        f"{'GEMM TFLOP/s':>13} {'of GEMM':>8}"
    )
    for row in prefill:
        hf = row.get("hf_ms")
        print(
            f"{row['shape']:>8} {row['ms']:>9.0f} {row['tok_s']:>8.0f} "
            + (f"{hf:>9.0f} {hf / row['ms']:>6.2f}x " if hf else f"{'-':>9} {'-':>7} ")
            + f"{row['gemm_tflops']:>13.3f} {row['tflops'] / row['gemm_tflops']:>7.0%}"
        )
    if args.tensor_parallel_size > 1:
        size = args.tensor_parallel_size
        print(f"tensor parallel {size} vs tp 1 (same run; speed-up = tp 1 time / tp {size} time)")
        for row in decode:
            print(
                f"  decode batch {row['batch']:>3}: tp 1 {row['ms_per_step']:8.1f} ms/step, "
                f"tp {size} {row['tp_ms_per_step']:8.1f} ms/step, speed-up "
                f"{row['ms_per_step'] / row['tp_ms_per_step']:.2f}x"
            )
        for row in prefill:
            print(
                f"  prefill {row['shape']:>8}: tp 1 {row['ms']:8.0f} ms, tp {size} "
                f"{row['tp_ms']:8.0f} ms, speed-up {row['ms'] / row['tp_ms']:.2f}x"
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
            "tensor_parallel_size": args.tensor_parallel_size,
            "read_gbs": bandwidth,
            "weight_bytes": weights,
            "decode": decode,
            "prefill": prefill,
        }
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":  # without the CLI's imports (Ray, the server), e.g. on a lent GPU
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_bench_parser(parser.add_subparsers(dest="bench", required=True), "tiny", "model")
    sys.exit(run_engine_benchmark(parser.parse_args(["engine", *sys.argv[1:]])))
