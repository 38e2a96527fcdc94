"""Runs one scheduled batch through the model: builds the flat inputs and the attention
metadata from the sequences' block tables, runs the forward pass, returns the logits of the
positions that sample a token (and the hidden states of prompts that want their logprobs)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention_metadata import build_metadata
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import PagedKVCache
from engine.model import LlamaModel
from engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.block_size
        self.graphs: DecodeGraphs | None = None  # CUDA: set by the engine once captured

    def run(
        self, batch: ScheduledBatch, layer_done: Callable[[int], None] | None = None
    ) -> tuple[torch.Tensor, list[int], dict[int, torch.Tensor]]:
        """Forward the batch. Returns (logits [n, V] fp32, indexes into batch.seqs of the n
        sequences whose prompt or token is now fully computed and so sample a token, and for
        each prompt chunk whose sequence asked for prompt logprobs, its index → its rows'
        hidden states [count, H])."""
        input_ids, positions, meta, last_rows, sampling = self.prepare(batch)
        if self.graphs is not None and layer_done is None and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta, self.cache, layer_done)
        logits = (
            self.model.compute_logits(hidden[last_rows]) if sampling else hidden.new_empty(0, 0)
        )
        prompt_hidden = {}
        row = 0
        for i, (seq, count) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            if (
                seq.params.prompt_logprobs is not None
                and seq.num_computed_tokens < seq.num_prompt_tokens
            ):
                prompt_hidden[i] = hidden[row : row + count]
            row += count
        return logits, sampling, prompt_hidden

    def prepare(self, batch: ScheduledBatch):
        """Flat model inputs for the batch: token ids, positions, attention metadata, the rows
        whose logits are sampled, and which sequences those are. Host work per sequence is
        constant for decode rows and proportional to the new tokens for prompt rows."""
        bs = self.block_size
        seqs, counts = batch.seqs, batch.num_new_tokens
        num_decode = next((i for i, n in enumerate(counts) if n != 1), len(counts))
        ids: list[int] = []
        positions: list[torch.Tensor | list[int]] = []
        slots: list[torch.Tensor | list[int]] = []
        decode_positions = []
        decode_slots = []
        for seq in seqs[:num_decode]:
            p = seq.num_computed_tokens
            ids.append(seq.token_ids[p])
            decode_positions.append(p)
            decode_slots.append(seq.block_table[p // bs] * bs + p % bs)
        positions.append(decode_positions)
        slots.append(decode_slots)
        last_rows = list(range(num_decode))  # decode rows always sample
        sampling = list(range(num_decode))
        row = num_decode
        for i in range(num_decode, len(seqs)):
            seq, count = seqs[i], counts[i]
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + count])
            span = torch.arange(start, start + count)
            table = torch.tensor(seq.block_table[: -(-(start + count) // bs)])
            positions.append(span)
            slots.append(table[span // bs] * bs + span % bs)
            row += count
            if start + count == seq.num_tokens:
                last_rows.append(row - 1)
                sampling.append(i)
        prefill = seqs[num_decode:]
        meta = build_metadata(
            slots=torch.cat([torch.as_tensor(s, dtype=torch.int64) for s in slots]),
            decode_tables=[s.block_table for s in seqs[:num_decode]],
            decode_context_lens=[p + 1 for p in decode_positions],
            prefill_tables=[s.block_table for s in prefill],
            prefill_new_lens=counts[num_decode:],
            prefill_prefix_lens=[s.num_computed_tokens for s in prefill],
            block_size=bs,
            fp8=self.cache.is_fp8,
            device=self.device,
        )
        to_device = lambda values: values.to(self.device, non_blocking=True)
        ids_t = to_device(torch.tensor(ids, dtype=torch.int64))
        pos_t = to_device(torch.cat([torch.as_tensor(p, dtype=torch.int64) for p in positions]))
        rows = to_device(torch.tensor(last_rows, dtype=torch.int64))
        return ids_t, pos_t, meta, rows, sampling
