"""What the attention layers of one forward pass need to know about the batch.

Built once per step by the model runner and passed down to every layer (the one per-forward
context of the engine). A batch is either all decode tokens (one new token per sequence,
served by the paged decode kernel) or a varlen batch of new tokens (prompt chunks, and
decode tokens mixed in, served by the prefill kernel with each sequence's cached prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    is_decode_only: bool
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + row) of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    block_runs: torch.Tensor | None  # [R, 4] int32, fp8 caches only (see kernels.kv_store)
    # varlen (prefill / mixed) batches
    cu_seqlens: torch.Tensor | None = None  # [B + 1] int32 offsets of each sequence's new tokens
    prefix_lens: torch.Tensor | None = None  # [B] int32 tokens already cached before the new ones
    max_new_len: int = 0
    # decode-only batches
    context_lens: torch.Tensor | None = None  # [B] int32, including the new token
    max_context_len: int = 0  # host-side, so kernels size their grid without a device sync
