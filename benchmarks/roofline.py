"""This machine's bounds, measured in the same run as a benchmark: how fast it reads memory
(decode is bound by reading the weights once per step) and how fast it runs the model's own
GEMMs (prefill is bound by them)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.config import ModelConfig


def best_of(fn, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """The fastest of ``repeats`` runs of ``fn`` (seconds), after one warm-up; on CUDA each
    run ends when the device has finished its work, not when its launches return."""
    device = torch.device(device)

    def run() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth_gbs(megabytes: int = 1024, device: torch.device | str = "cpu") -> float:
    """GB/s of a sum over a buffer far larger than the caches (read once, no write); on a GPU
    4 GiB, well past its L2."""
    if torch.device(device).type == "cuda":
        megabytes = max(megabytes, 4096)
    data = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    seconds = best_of(lambda: data.sum(), device=device)
    return data.numel() * 4 / seconds / 1e9


def model_gemms(config: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's GEMMs as the engine runs them (fused QKV, fused
    gate_up)."""
    c = config
    return [
        (c.hidden_size, c.qkv_size),
        (c.q_size, c.hidden_size),
        (c.hidden_size, 2 * c.intermediate_size),
        (c.intermediate_size, c.hidden_size),
    ]


def gemm_layer(
    config: ModelConfig,
    tokens: int,
    dtype: torch.dtype,
    linear=F.linear,
    device: torch.device | str = "cpu",
) -> tuple[Callable[[], None], int]:
    """One layer's GEMMs at ``tokens`` rows in ``dtype`` through ``linear`` (a forward made
    only of GEMMs: the prefill bound at that size), and their FLOPs."""
    shapes = model_gemms(config)
    weights = [torch.randn(n_out, n_in, device=device).to(dtype) for n_in, n_out in shapes]
    inputs = {n_in: torch.randn(tokens, n_in, device=device).to(dtype) for n_in, _ in shapes}

    def layer() -> None:
        for (n_in, _), weight in zip(shapes, weights, strict=True):
            linear(inputs[n_in], weight)

    return layer, sum(2 * tokens * n_in * n_out for n_in, n_out in shapes)


def prefill_flops(config: ModelConfig, prompt_lens: list[int]) -> float:
    """Useful FLOPs of prefilling these prompts: every layer's GEMMs for every token, causal
    attention (QKᵀ and PV over the pairs each token sees), the LM head for the last token."""
    c = config
    per_token = sum(2 * n_in * n_out for n_in, n_out in model_gemms(c)) * c.num_layers
    pairs = sum(n * (n + 1) // 2 for n in prompt_lens)
    attention = 4 * c.num_heads * c.head_dim * pairs * c.num_layers
    head = 2 * c.hidden_size * c.vocab_size * len(prompt_lens)
    return per_token * sum(prompt_lens) + attention + head


def weight_bytes(model: torch.nn.Module, plan=None, rows: int = 1) -> int:
    """Bytes one decode step of ``rows`` tokens reads: every weight once (a tied embedding is
    read whole by the LM head; the rotary tables are buffers, not weights), as its GGUF
    blocks where the CPU GEMM ``plan`` runs that row count on them."""
    on_blocks = plan is not None and plan.choice_for(rows) == "gguf"
    total = 0
    for p in model.parameters():
        blocks = plan.quantized.blocks.get(p) if on_blocks else None
        total += blocks.nbytes if blocks is not None else p.numel() * p.element_size()
    return total
