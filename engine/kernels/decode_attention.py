"""Paged decode attention (one new query token per sequence), split-K "flash-decoding".

Cache layout: ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]`` in
fp32/fp16/bf16, or fp8 e4m3 with per-(block, kv head) float32 scales ``[num_blocks, Hkv]``.
Token ``p`` of sequence ``b`` lives in block ``block_tables[b, p // block_size]``, row
``p % block_size``. The query token's own K/V is already in the cache; ``context_lens``
counts it.

Phase 1 runs one program per (sequence, kv head, split). It handles every q head of that kv
head's GQA group at once (a ``[BLOCK_G, D]`` query tile), so each K/V page is read from HBM
once per group rather than once per q head -- decode is bandwidth bound, and this is what
keeps GQA models at HBM speed. Each program writes a normalised partial output and its
log-sum-exp (base 2). Phase 2 combines the splits. With one split, phase 1 writes the final
output directly and phase 2 is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.fp8 import FP8_DTYPE, round_to_bf16_grid
from engine.kernels.paged import load_paged_kv_tile

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634
# Programs to aim for in phase 1: two waves over an H100/H200's 132 SMs.
_ASSUMED_NUM_SMS = 132
# Fewer tokens than this per split and the partial results cost more than they save.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64


@triton.jit
def _decode_attention_split_kernel(
    q_ptr,  # [B, Hq, D]
    stride_qb,
    stride_qh,
    stride_qd,
    kc_ptr,  # [num_blocks, BS, Hkv, D]
    stride_kcb,
    stride_kcr,
    stride_kch,
    stride_kcd,
    vc_ptr,  # [num_blocks, BS, Hkv, D]
    stride_vcb,
    stride_vcr,
    stride_vch,
    stride_vcd,
    ks_ptr,  # [num_blocks, Hkv] float32 (fp8 only)
    stride_ksb,
    stride_ksh,
    vs_ptr,  # [num_blocks, Hkv] float32 (fp8 only)
    stride_vsb,
    stride_vsh,
    bt_ptr,  # [B, max_blocks] int32
    stride_btb,
    ctx_ptr,  # [B] int32
    out_ptr,  # SINGLE_SPLIT: [B, Hq, D] final output; else [B, Hq, S, D] fp32 partials
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    lse_ptr,  # [B, Hq, S] fp32 (unused when SINGLE_SPLIT)
    stride_lb,
    stride_lh,
    stride_ls,
    qk_scale,  # softmax_scale * log2(e)
    num_splits,  # runtime: a new split count launches the same compiled kernel
    GROUP: tl.constexpr,  # q heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block (page) size
    SINGLE_SPLIT: tl.constexpr,  # phase 1 writes the final output
    IS_FP8: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: do all arithmetic in fp32
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    ctx_len = tl.load(ctx_ptr + seq)
    # Per-sequence split sizes, rounded to whole key tiles, balance ragged batches.
    split_len = tl.cdiv(tl.cdiv(ctx_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    q_heads = kv_head * GROUP + offs_g  # [BLOCK_G]

    q = tl.load(
        q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_G, D]
    if UPCAST:
        q = q.to(tl.float32)
    compute_dtype = q.dtype

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    bt_row = bt_ptr + seq * stride_btb
    kc_head = kc_ptr + kv_head * stride_kch
    vc_head = vc_ptr + kv_head * stride_vch
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n  # [BLOCK_N] absolute positions
        tok_ok = tok < end
        page, k, v = load_paged_kv_tile(
            bt_row,
            kc_head,
            vc_head,
            tok,
            tok_ok,
            offs_d,
            d_ok,
            stride_kcb,
            stride_kcr,
            stride_kcd,
            stride_vcb,
            stride_vcr,
            stride_vcd,
            BLOCK_SIZE,
        )  # [N], [N, D], [N, D]

        # fp8 e4m3 values are exact in fp16/bf16/fp32, so K can enter the dot unscaled and
        # its per-page scale is applied to the fp32 scores instead (one multiply per score).
        qk = tl.dot(q, tl.trans(k.to(compute_dtype)), input_precision=DOT_PRECISION)
        if IS_FP8:
            k_scale = tl.load(
                ks_ptr + page * stride_ksb + kv_head * stride_ksh, mask=tok_ok, other=0.0
            )
            qk = qk * (k_scale * qk_scale)[None, :]
        else:
            qk = qk * qk_scale
        qk = tl.where(tok_ok[None, :], qk, float("-inf"))  # [BLOCK_G, BLOCK_N]

        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if IS_FP8:
            # V is dequantised elementwise: folding its scale into p could push p below
            # fp16's normal range.
            v_scale = tl.load(
                vs_ptr + page * stride_vsb + kv_head * stride_vsh, mask=tok_ok, other=0.0
            )
            v = v.to(tl.float32) * v_scale[:, None]
        acc += tl.dot(p.to(compute_dtype), v.to(compute_dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (start >= end) leaves l_i == 0: write o = 0 and lse = -inf.
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_mask = g_ok[:, None] & d_ok[None, :]
    out_ptrs = (
        out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    )
    if SINGLE_SPLIT:
        if ROUND_BF16:
            out = round_to_bf16_grid(out)
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptrs + split * stride_os, out, mask=out_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(
            lse_ptr + seq * stride_lb + q_heads * stride_lh + split * stride_ls, lse, mask=g_ok
        )


@triton.jit
def _decode_attention_reduce_kernel(
    part_ptr,  # [B, Hq, S, D] fp32
    stride_pb,
    stride_ph,
    stride_ps,
    stride_pd,
    lse_ptr,  # [B, Hq, S] fp32
    stride_lb,
    stride_lh,
    stride_ls,
    out_ptr,  # [B, Hq, D]
    stride_ob,
    stride_oh,
    stride_od,
    num_splits,  # runtime, at most BLOCK_S
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM

    lse = tl.load(
        lse_ptr + seq * stride_lb + head * stride_lh + offs_s * stride_ls,
        mask=s_ok,
        other=float("-inf"),
    )  # [BLOCK_S]
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no keys at all: weights all 0, output 0
    w = tl.exp2(lse - m)  # [BLOCK_S]
    part = tl.load(
        part_ptr
        + seq * stride_pb
        + head * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :] * stride_pd,
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_S, D]
    denom = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)  # [D]
    if ROUND_BF16:
        out = round_to_bf16_grid(out)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


def check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be float32/float16/bfloat16, got {q.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"cache head_dim {cache_head_dim} != q head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} not a multiple of num_kv_heads {num_kv_heads}")
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 8, got {block_size}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    if k_cache.dtype == FP8_DTYPE:
        expected = (k_cache.shape[0], num_kv_heads)
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None or s.dtype != torch.float32 or tuple(s.shape) != expected:
                raise ValueError(
                    f"fp8 caches need {name} float32 [num_blocks, num_kv_heads] = {expected}, got "
                    f"{None if s is None else (s.dtype, tuple(s.shape))}"
                )
    elif k_cache.dtype != q.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype} must be fp8 or match q dtype {q.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [B={batch}, max_blocks], got shape {tuple(block_tables.shape)}"
        )
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if context_lens.shape != (batch,) or context_lens.dtype != torch.int32:
        raise ValueError(
            f"context_lens must be int32 [B={batch}], got {context_lens.dtype} "
            f"{tuple(context_lens.shape)}"
        )


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context_len: int, num_sms: int = _ASSUMED_NUM_SMS
) -> int:
    """Splits per (sequence, kv head) so phase 1 fills ~2 waves of SMs.

    Never so many that a split gets fewer than ``_MIN_TOKENS_PER_SPLIT`` tokens of the longest
    context: short contexts are cheap anyway and the partials would dominate.
    """
    target_programs = 2 * num_sms
    want = triton.cdiv(target_programs, max(batch * num_kv_heads, 1))
    useful = triton.cdiv(max(max_context_len, 1), _MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, useful, _MAX_SPLITS))


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    num_splits: int | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """Torch reference (and CPU production path): one gather + batched matmuls, all in fp32.

    ``num_splits`` is accepted for signature parity and ignored.
    """
    check_decode_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if batch else 0
    num_pages = max(triton.cdiv(max_context_len, block_size), 1)

    ctx = context_lens.long()
    page_idx = torch.arange(num_pages, device=q.device)
    # Unused block-table entries may hold anything: point them at block 0 and mask below.
    pages = block_tables[:, :num_pages].long()
    pages = torch.where(page_idx[None] * block_size < ctx[:, None], pages, 0)  # [B, P]
    length = num_pages * block_size

    def gather(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        # index_select copies whole blocks; much faster on CPU than advanced indexing.
        flat = pages.flatten()
        x = (
            cache.index_select(0, flat)
            .float()
            .view(batch, num_pages, block_size, num_kv_heads, head_dim)
        )
        if scale is not None:
            x = x * scale.index_select(0, flat).view(batch, num_pages, 1, num_kv_heads, 1)
        return x.reshape(batch, length, num_kv_heads, head_dim)

    fp8 = k_cache.dtype == FP8_DTYPE
    valid = torch.arange(length, device=q.device)[None] < ctx[:, None]  # [B, L]
    # Rows past the context may hold garbage (even NaN): zero them in the gathered copies so
    # that neither a score nor 0 * NaN can leak into the output. They are few (the last
    # page's tail and padding pages), so index them rather than mask every row.
    invalid_rows = (~valid).flatten().nonzero().squeeze(1)
    k = gather(k_cache, k_scale if fp8 else None)  # [B, L, Hkv, D]
    v = gather(v_cache, v_scale if fp8 else None)  # [B, L, Hkv, D]
    k.view(batch * length, -1).index_fill_(0, invalid_rows, 0.0)
    v.view(batch * length, -1).index_fill_(0, invalid_rows, 0.0)
    qf = q.float().view(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    # The G query heads of a KV head act as G query rows, so one SDPA call covers GQA.
    out = torch.nn.functional.scaled_dot_product_attention(
        qf,
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=softmax_scale,
    )  # [B, Hkv, G, D]
    out = out.nan_to_num_(0.0)  # a context of 0 tokens masks every score: zeros, not NaN
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    num_splits: int | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """Triton path: split-K phase 1 over (seq, kv head, split), then a reduce over splits.

    ``max_context_len`` (an upper bound is fine) only feeds the automatic ``num_splits``
    choice; pass it to avoid a device -> host sync on ``context_lens.max()``.
    """
    check_decode_args(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out

    if num_splits is None:
        if max_context_len is None:
            max_context_len = int(context_lens.max())
        num_sms = _ASSUMED_NUM_SMS
        if q.is_cuda:
            num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        num_splits = choose_num_splits(batch, num_kv_heads, max_context_len, num_sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    # The kernel indexes these with unit strides along their last dimension.
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    fp8 = k_cache.dtype == FP8_DTYPE
    interpret = dispatch.interpreter_active()
    dummy_scale = torch.empty((1, 1), dtype=torch.float32, device=q.device)
    ks = k_scale if fp8 else dummy_scale
    vs = v_scale if fp8 else dummy_scale
    round_bf16 = interpret and q.dtype == torch.bfloat16
    block_d = triton.next_power_of_2(head_dim)

    if num_splits == 1:
        part, lse = out, out  # phase 1 writes the final output; lse is never touched
        part_strides = (out.stride(0), out.stride(1), 0, out.stride(2))
        lse_strides = (0, 0, 0)
    else:
        part = torch.empty(
            (batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        part_strides = part.stride()
        lse_strides = lse.stride()

    _decode_attention_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        *q.stride(),
        k_cache,
        *k_cache.stride(),
        v_cache,
        *v_cache.stride(),
        ks,
        *ks.stride(),
        vs,
        *vs.stride(),
        block_tables,
        block_tables.stride(0),
        context_lens,
        part,
        *part_strides,
        lse,
        *lse_strides,
        softmax_scale * _LOG2E,
        num_splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        # tl.dot needs M >= 16; padded q rows cost nothing extra in HBM traffic.
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=64,
        BLOCK_SIZE=block_size,
        SINGLE_SPLIT=num_splits == 1,
        IS_FP8=fp8,
        UPCAST=interpret,
        DOT_PRECISION="ieee" if (interpret or q.dtype == torch.float32) else "tf32",
        ROUND_BF16=round_bf16,
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        _decode_attention_reduce_kernel[(batch, num_q_heads)](
            part,
            *part.stride(),
            lse,
            *lse.stride(),
            out,
            *out.stride(),
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
            ROUND_BF16=round_bf16,
            num_warps=4 if block_d >= 128 else 2,
        )
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    softmax_scale: float,
    num_splits: int | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """Paged decode attention: q ``[B, Hq, D]`` over each sequence's cached context.

    Returns ``[B, Hq, D]`` in q's dtype. See the module docstring for the cache layout.
    """
    fn = decode_attention_triton if dispatch.use_triton(q) else decode_attention_reference
    return fn(
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables,
        context_lens,
        softmax_scale,
        num_splits,
        max_context_len,
    )


__all__ = [
    "choose_num_splits",
    "decode_attention",
    "decode_attention_reference",
    "decode_attention_triton",
]
