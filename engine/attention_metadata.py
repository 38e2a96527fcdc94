"""What the attention layers of one forward pass need to know about the batch.

Built once per step by the model runner and passed down to every layer (the one per-forward
context of the engine). A batch's rows are its new tokens: first the decode rows (sequences
computing one token over their cached context, served by the paged decode kernel), then the
prefill rows (prompt chunks over their cached prefix, served by the prefill kernel). Either
part may be empty. On CPU each part also carries what every layer would otherwise recompute
(the pages to gather, the masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.cpu_attention import DecodePlan, PrefillPlan, decode_plan, prefill_plan
from engine.kernels.kv_store import block_runs_from_slots


@dataclass(frozen=True)
class DecodeMetadata:
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32, including the new token
    max_context_len: int  # host-side, so kernels size their grid without a device sync
    cpu: DecodePlan | None = None


@dataclass(frozen=True)
class PrefillMetadata:
    cu_seqlens: torch.Tensor  # [B + 1] int32 offsets of each sequence's new tokens
    prefix_lens: torch.Tensor  # [B] int32 tokens already cached before the new ones
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_new_len: int
    cpu: PrefillPlan | None = None


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + row) of each new token
    block_runs: torch.Tensor | None  # [R, 4] int32, fp8 caches only (see kernels.kv_store)
    num_decode_tokens: int  # the first rows; the rest are prefill rows
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None

    @property
    def is_decode_only(self) -> bool:
        return self.prefill is None


def build_metadata(
    *,
    slots: torch.Tensor,  # [T] int64, host
    decode_tables: list[list[int]],
    decode_context_lens: list[int],
    prefill_tables: list[list[int]],
    prefill_new_lens: list[int],
    prefill_prefix_lens: list[int],
    block_size: int,
    fp8: bool,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for a batch of ``len(decode_tables)`` decode rows followed by prompt chunks
    of ``prefill_new_lens`` tokens. Host-side lists in; tensors on ``device`` out."""
    on_cpu = device.type == "cpu"
    decode = prefill = None
    if decode_tables:
        tables = _padded(decode_tables)
        decode = DecodeMetadata(
            block_tables=tables.to(device),
            context_lens=torch.tensor(decode_context_lens, dtype=torch.int32).to(device),
            max_context_len=max(decode_context_lens),
            cpu=decode_plan(tables, decode_context_lens, block_size) if on_cpu else None,
        )
    if prefill_tables:
        tables = _padded(prefill_tables)
        cu = [0]
        for n in prefill_new_lens:
            cu.append(cu[-1] + n)
        prefill = PrefillMetadata(
            cu_seqlens=torch.tensor(cu, dtype=torch.int32).to(device),
            prefix_lens=torch.tensor(prefill_prefix_lens, dtype=torch.int32).to(device),
            block_tables=tables.to(device),
            max_new_len=max(prefill_new_lens),
            cpu=prefill_plan(cu, prefill_prefix_lens, tables, block_size) if on_cpu else None,
        )
    return AttentionMetadata(
        slot_mapping=slots.to(device),
        block_runs=block_runs_from_slots(slots, block_size).to(device) if fp8 else None,
        num_decode_tokens=len(decode_tables),
        decode=decode,
        prefill=prefill,
    )


def _padded(tables: list[list[int]]) -> torch.Tensor:
    """[B, max_blocks] int32; rows shorter than the longest padded with block 0."""
    width = max(len(t) for t in tables)
    out = torch.zeros(len(tables), max(width, 1), dtype=torch.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return out
