"""Runs one scheduled batch through the model: builds the flat inputs and the attention
metadata from the sequences' block tables, runs the forward pass, returns the logits of the
positions that sample a token."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention_metadata import AttentionMetadata
from engine.kernels.kv_store import block_runs_from_slots
from engine.kv_cache import PagedKVCache
from engine.model import LlamaModel
from engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.block_size

    def run(
        self, batch: ScheduledBatch, layer_done: Callable[[int], None] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Forward the batch. Returns (logits [n, V] fp32, indexes into batch.seqs of the n
        sequences whose prompt or token is now fully computed and so sample a token)."""
        input_ids, positions, meta, last_rows, sampling = self.prepare(batch)
        hidden = self.model(input_ids, positions, meta, self.cache, layer_done)
        logits = (
            self.model.compute_logits(hidden[last_rows]) if sampling else hidden.new_empty(0, 0)
        )
        return logits, sampling

    def prepare(self, batch: ScheduledBatch):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefix_lens: list[int] = []
        cu_seqlens = [0]
        last_rows: list[int] = []
        sampling: list[int] = []
        for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            end = start + count
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            span = range(start, end)
            positions.extend(span)
            slots.extend(table[p // bs] * bs + p % bs for p in span)
            prefix_lens.append(start)
            cu_seqlens.append(cu_seqlens[-1] + count)
            if end == seq.num_tokens:
                last_rows.append(cu_seqlens[-1] - 1)
                sampling.append(i)
        max_blocks = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in batch.seqs]
        slot_mapping = torch.tensor(slots, dtype=torch.int64)
        block_runs = (
            block_runs_from_slots(slot_mapping, bs).to(self.device) if self.cache.is_fp8 else None
        )
        to_device = lambda values, dtype: torch.tensor(values, dtype=dtype).to(
            self.device, non_blocking=True
        )
        block_tables = to_device(tables, torch.int32)
        if batch.is_decode_only:
            meta = AttentionMetadata(
                is_decode_only=True,
                slot_mapping=slot_mapping.to(self.device),
                block_tables=block_tables,
                block_runs=block_runs,
                context_lens=to_device([p + 1 for p in prefix_lens], torch.int32),
                max_context_len=max(prefix_lens) + 1,
            )
        else:
            meta = AttentionMetadata(
                is_decode_only=False,
                slot_mapping=slot_mapping.to(self.device),
                block_tables=block_tables,
                block_runs=block_runs,
                cu_seqlens=to_device(cu_seqlens, torch.int32),
                prefix_lens=to_device(prefix_lens, torch.int32),
                max_new_len=max(batch.num_new_tokens),
            )
        ids = to_device(input_ids, torch.int64)
        pos = to_device(positions, torch.int64)
        rows = to_device(last_rows, torch.int64)
        return ids, pos, meta, rows, sampling
