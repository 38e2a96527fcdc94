"""Attention on CPU: torch's fused SDPA kernels over pages gathered once per step.

The CPU production path of decode and prefill attention (the Triton kernels are the CUDA
path; the ``*_reference`` functions beside them define the result, and tests hold these to
them). What one forward's layers share -- which cache pages each sequence reads, its mask --
is worked out once per step (``decode_plan``, ``prefill_plan``), not once per layer.

- Decode: every sequence's pages are gathered into ``[B, L, Hkv, D]`` and one SDPA call
  covers the batch, the G query heads of a KV head acting as G query rows (GQA without
  copying K/V). Rows past a sequence's context are masked; they are zeroed in the copy too,
  since a masked score times a garbage (NaN) value would still be NaN.
- Prefill: one SDPA call per sequence, never an ``[S, S]`` score tensor. A prompt with no
  cached prefix takes the causal flash kernel, which skips fully masked key blocks; a prompt
  chunk after a prefix gets its keys from the pages plus its own, with a bottom-right causal
  mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.fp8 import FP8_DTYPE


@dataclass(frozen=True)
class DecodePlan:
    """Per step: the pages every layer gathers for a decode batch."""

    batch: int
    length: int  # gathered rows per sequence (whole pages)
    pages: torch.Tensor  # [B * P] int64 block ids (unused table entries point at block 0)
    mask: torch.Tensor | None  # [B, 1, 1, L] bool, None when every row of every page is real
    invalid_rows: torch.Tensor | None  # [n] int64 rows of the flat [B * L] copy past a context


def decode_plan(block_tables: torch.Tensor, context_lens: list[int], block_size: int) -> DecodePlan:
    batch = len(context_lens)
    num_pages = max(-(-max(context_lens, default=1) // block_size), 1)
    length = num_pages * block_size
    ctx = torch.tensor(context_lens, dtype=torch.int64)
    pages = block_tables[:, :num_pages].long()
    page_start = torch.arange(num_pages)[None] * block_size
    pages = torch.where(page_start < ctx[:, None], pages, 0).flatten()
    if all(n == length for n in context_lens):
        return DecodePlan(batch, length, pages, None, None)
    valid = torch.arange(length)[None] < ctx[:, None]  # [B, L]
    invalid = (~valid).flatten().nonzero().squeeze(1)
    return DecodePlan(batch, length, pages, valid[:, None, None, :], invalid)


def decode_attention_cpu(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,  # [N, Hkv] fp32, fp8 caches only
    v_scale: torch.Tensor | None,
    plan: DecodePlan,
    softmax_scale: float,
) -> torch.Tensor:
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    dtype = q.dtype if k_cache.dtype != FP8_DTYPE else torch.float32

    def gather(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        x = cache.index_select(0, plan.pages)  # [B * P, bs, Hkv, D]
        if scale is not None:
            x = x.float() * scale.index_select(0, plan.pages)[:, None, :, None]
        x = x.to(dtype).view(batch * plan.length, num_kv_heads, head_dim)
        if plan.invalid_rows is not None:
            x.index_fill_(0, plan.invalid_rows, 0.0)
        return x.view(batch, plan.length, num_kv_heads, head_dim).transpose(1, 2)

    fp8 = k_cache.dtype == FP8_DTYPE
    k = gather(k_cache, k_scale if fp8 else None)  # [B, Hkv, L, D]
    v = gather(v_cache, v_scale if fp8 else None)
    out = F.scaled_dot_product_attention(
        q.to(dtype).view(batch, num_kv_heads, group, head_dim),
        k,
        v,
        attn_mask=plan.mask,
        scale=softmax_scale,
    )  # [B, Hkv, G, D]
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


@dataclass(frozen=True)
class PrefillSequence:
    start: int  # its first new token's row in the batch
    end: int
    prefix: int  # tokens already cached
    pages: torch.Tensor | None  # [P] int64 pages holding the prefix
    mask: torch.Tensor | None  # [new, prefix + new] bool, when there is a prefix


def prefill_plan(
    cu_seqlens: list[int], prefix_lens: list[int], block_tables: torch.Tensor, block_size: int
) -> list[PrefillSequence]:
    sequences = []
    for b, prefix in enumerate(prefix_lens):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        if end == start:
            continue
        if prefix == 0:
            sequences.append(PrefillSequence(start, end, 0, None, None))
            continue
        pages = block_tables[b, : -(-prefix // block_size)].long()
        new = torch.arange(end - start)[:, None]
        keys = torch.arange(prefix + end - start)[None, :]
        sequences.append(PrefillSequence(start, end, prefix, pages, keys <= prefix + new))
    return sequences


def prefill_attention_cpu(
    q: torch.Tensor,  # [T, Hq, D] new tokens of every sequence
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    plan: list[PrefillSequence],
    softmax_scale: float,
) -> torch.Tensor:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    fp8 = k_cache.dtype == FP8_DTYPE
    out = torch.empty_like(q)

    def cached(cache: torch.Tensor, scale: torch.Tensor | None, seq: PrefillSequence):
        x = cache.index_select(0, seq.pages)  # [P, bs, Hkv, D]
        if fp8:
            x = x.float() * scale.index_select(0, seq.pages)[:, None, :, None]
        return x.to(q.dtype).reshape(-1, num_kv_heads, head_dim)[: seq.prefix]

    for seq in plan:
        keys, values = k[seq.start : seq.end], v[seq.start : seq.end]
        if seq.prefix:
            keys = torch.cat([cached(k_cache, k_scale, seq), keys])
            values = torch.cat([cached(v_cache, v_scale, seq), values])
        attended = F.scaled_dot_product_attention(
            q[seq.start : seq.end].transpose(0, 1)[None],  # [1, Hq, new, D]
            keys.transpose(0, 1)[None],  # [1, Hkv, S, D]
            values.transpose(0, 1)[None],
            attn_mask=seq.mask,
            is_causal=seq.mask is None,
            scale=softmax_scale,
            enable_gqa=True,
        )
        out[seq.start : seq.end] = attended[0].transpose(0, 1)
    return out
