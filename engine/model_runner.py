"""Runs one scheduled batch through the model: describes the batch as host data (a
``StepPlan``), builds the flat inputs and the attention metadata from it, runs the forward
pass, returns the logits of the positions that sample a token (and the hidden states of
prompts that want their logprobs).

Under tensor parallelism the driver's runner sends each step's plan to the other ranks
(engine.tp_worker), which build the same inputs on their own devices and run their shards
in step with it; only the driver computes logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention_metadata import AttentionMetadata, build_metadata
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import PagedKVCache
from engine.model import LlamaModel
from engine.scheduler import ScheduledBatch


@dataclass(frozen=True)
class StepPlan:
    """One forward pass as host data: everything a rank needs to run its shard of it."""

    input_ids: list[int]
    positions: torch.Tensor  # [T] int64, host
    slots: torch.Tensor  # [T] int64, host
    decode_tables: list[list[int]]
    decode_context_lens: list[int]
    prefill_tables: list[list[int]]
    prefill_new_lens: list[int]
    prefill_prefix_lens: list[int]
    copies: list[tuple[int, int]]  # (source, destination) blocks to copy first
    service: Any = None  # the driver's worker's data for the ranks' services (tp_worker)


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.block_size
        self.tp = model.tp
        self.graphs: DecodeGraphs | None = None  # CUDA: set by the engine once captured

    def run(
        self,
        batch: ScheduledBatch,
        layer_done: Callable[[int], None] | None = None,
        rank_data: Any = None,
    ) -> tuple[torch.Tensor, list[int], dict[int, torch.Tensor]]:
        """Forward the batch (``rank_data`` goes with its plan to the other ranks). Returns
        (logits [n, V] fp32, indexes into batch.seqs of the n sequences whose prompt or token
        is now fully computed and so sample a token, and for each prompt chunk whose
        sequence asked for prompt logprobs, its index → its rows' hidden states [count, H])."""
        plan, last_rows, sampling = self.plan(batch)
        if self.tp.size > 1:
            self.tp.send(
                plan if rank_data is None else dataclasses.replace(plan, service=rank_data)
            )
        hidden = self.forward(plan, layer_done)
        rows = torch.tensor(last_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        logits = self.model.compute_logits(hidden[rows]) if sampling else hidden.new_empty(0, 0)
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

    def forward(
        self, plan: StepPlan, layer_done: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Make the plan's block copies, then run its forward: hidden states [T, H]. Every
        rank of a tensor-parallel engine calls this with the same plan."""
        self.cache.copy_blocks(plan.copies)
        input_ids, positions, meta = self.inputs(plan)
        if self.graphs is not None and layer_done is None and self.graphs.can_run(meta):
            return self.graphs.run(input_ids, positions, meta)
        return self.model(input_ids, positions, meta, self.cache, layer_done)

    def inputs(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The plan's token ids, positions and attention metadata, on this rank's device."""
        meta = build_metadata(
            slots=plan.slots,
            decode_tables=plan.decode_tables,
            decode_context_lens=plan.decode_context_lens,
            prefill_tables=plan.prefill_tables,
            prefill_new_lens=plan.prefill_new_lens,
            prefill_prefix_lens=plan.prefill_prefix_lens,
            block_size=self.block_size,
            fp8=self.cache.is_fp8,
            device=self.device,
        )
        ids = torch.tensor(plan.input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        return ids, plan.positions.to(self.device, non_blocking=True), meta

    def prepare(self, batch: ScheduledBatch):
        """The batch's device inputs, for callers that run the model themselves (tests,
        benchmarks): token ids, positions, metadata, sampled rows, their sequences."""
        plan, last_rows, sampling = self.plan(batch)
        ids, positions, meta = self.inputs(plan)
        return ids, positions, meta, torch.tensor(last_rows, dtype=torch.int64), sampling

    def plan(self, batch: ScheduledBatch) -> tuple[StepPlan, list[int], list[int]]:
        """The batch as a StepPlan, the rows whose logits are sampled, and which sequences
        those are. Host work per sequence is constant for decode rows and proportional to
        the new tokens for prompt rows."""
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
        plan = StepPlan(
            input_ids=ids,
            positions=torch.cat([torch.as_tensor(p, dtype=torch.int64) for p in positions]),
            slots=torch.cat([torch.as_tensor(s, dtype=torch.int64) for s in slots]),
            decode_tables=[s.block_table for s in seqs[:num_decode]],
            decode_context_lens=[p + 1 for p in decode_positions],
            prefill_tables=[s.block_table for s in prefill],
            prefill_new_lens=counts[num_decode:],
            prefill_prefix_lens=[s.num_computed_tokens for s in prefill],
            copies=batch.copies,
        )
        return plan, last_rows, sampling
