"""CUDA graphs of the decode forward at bucketed batch sizes, and the start-up warm-up that
compiles and tunes every kernel variant serving will use.

A decode step of a 30-layer model is a few hundred small kernel launches; on a GPU their
launch gaps, not the work, set the step time. So (as nano-vllm and vLLM do) the decode forward
is captured once per batch-size bucket and replayed: the batch is padded up to its bucket
(padding rows write no KV — slot -1 — and attend to nothing — context 0) and its inputs are
copied into the graph's static buffers.

Not captured: mixed and prefill batches (their shapes vary too much), batches above the
largest bucket, and fp8 KV caches (the fp8 store is launched per block run, a count that
varies with the batch). Those run eagerly. Callers: ``LLMEngine`` on CUDA builds one
``DecodeGraphs`` after ``warm_up``; ``ModelRunner.run`` asks ``can_run`` each step.
"""

from __future__ import annotations

import logging

import torch

from engine.attention_metadata import AttentionMetadata, DecodeMetadata
from engine.kernels.decode_attention import decode_attention_triton
from engine.kv_cache import PagedKVCache
from engine.model import LlamaModel

logger = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch``."""
    small = [b for b in (1, 2, 4, 8) if b <= max_batch]
    return small + list(range(16, max_batch + 1, 16))


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        cache: PagedKVCache,
        max_batch: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.cache = cache
        self.buckets = graph_buckets(max_batch)
        self.max_model_len = max_model_len
        device = cache.device
        top = self.buckets[-1]
        width = -(-max_model_len // cache.block_size)
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(top, width, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its memory pool)."""
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.buckets):
            meta = self._metadata(batch)
            args = (self.input_ids[:batch], self.positions[:batch], meta, self.cache)
            self.model(*args)  # compiled and tuned outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(*args)
            self._graphs[batch] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (
            bool(self._graphs)
            and meta.is_decode_only
            and meta.num_decode_tokens <= self.buckets[-1]
            and meta.block_runs is None
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The decode forward's hidden states [B, H] for this batch, by graph replay."""
        n = meta.num_decode_tokens
        batch = next(b for b in self.buckets if b >= n)
        decode = meta.decode
        width = decode.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(decode.block_tables)
        self.context_lens[:n].copy_(decode.context_lens)
        if batch > n:  # padding rows: no KV written, no keys read
            self.input_ids[n:batch].zero_()
            self.positions[n:batch].zero_()
            self.slot_mapping[n:batch].fill_(-1)
            self.context_lens[n:batch].zero_()
        graph, hidden = self._graphs[batch]
        graph.replay()
        return hidden[:n]

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            block_runs=None,
            num_decode_tokens=batch,
            decode=DecodeMetadata(
                block_tables=self.block_tables[:batch],
                context_lens=self.context_lens[:batch],
                # Only sizes the split-K grid: the longest context any request may reach, so
                # one captured split count serves every step.
                max_context_len=self.max_model_len,
            ),
            prefill=None,
        )


@torch.inference_mode()
def warm_up_kernels(model: LlamaModel, cache: PagedKVCache, max_num_batched_tokens: int) -> None:
    """Compile and autotune, at start-up, every kernel variant serving will launch: each GEMM
    at each row bucket its autotuner keys on, and the decode kernel at every split-count
    bucket (its reduce kernel's tile), so no request waits for a compile."""
    device = cache.device
    dtype = model.embed_weight.dtype
    layer = model.layers[0]
    gemms = [
        (layer.qkv_weight, layer.qkv_bias, None),
        (layer.o_weight, layer.o_bias, None),
        (layer.gate_up_weight, layer.gate_up_bias, "silu_mul"),
        (layer.down_weight, layer.down_bias, None),
        (model.embed_weight if model.lm_head_weight is None else model.lm_head_weight, None, None),
    ]
    rows = 1
    while rows <= max_num_batched_tokens:
        for weight, bias, activation in gemms:
            x = torch.randn(rows, weight.shape[1], device=device, dtype=dtype)
            model.linear(x, weight, bias, activation=activation)
        rows *= 2
    layer_kv = cache.layer(0)
    heads = model.config.num_heads
    q = torch.randn(1, heads, model.config.head_dim, device=device, dtype=dtype)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
    ctx = torch.ones(1, dtype=torch.int32, device=device)
    splits = 1
    while splits <= 64:
        decode_attention_triton(
            q,
            layer_kv.k,
            layer_kv.v,
            layer_kv.k_scale,
            layer_kv.v_scale,
            tables,
            ctx,
            model.layers[0].softmax_scale,
            num_splits=splits,
        )
        splits *= 2
    torch.cuda.synchronize()
