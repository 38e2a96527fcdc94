"""Causal flash attention for prefill over packed sequences with a paged prefix.

``q [T, Hq, D]`` and ``k, v [T, Hkv, D]`` hold the NEW tokens of ``B`` packed sequences
(``cu_seqlens`` int32 ``[B+1]``). Sequence ``b`` already has ``prefix_lens[b]`` tokens in the
paged cache (a prefix-cache hit, or earlier chunks of a chunked prefill). New token ``i`` of
sequence ``b`` sits at absolute position ``prefix_lens[b] + i`` and attends to

* every prefix token, read from the paged cache (dequantised in-kernel when fp8), and
* the new tokens ``j <= i``, read from the contiguous ``k, v`` (not from the cache).

The model calls ``store_kv`` for the new tokens and then this kernel in the same forward.

The Triton kernel is FlashAttention-2 style: grid ``(q blocks, q heads, sequences)``, online
softmax in base 2 (log2(e) folded into the scale), the ``[S, S]`` matrix is never formed. Key
tiles of the new part strictly below the diagonal need no mask, tiles past the query block are
never visited, and the causal mask is applied only on the diagonal tiles.
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


@triton.jit
def _online_softmax_step(
    qk, v, m_i, l_i, acc, COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """Folds one tile of base-2 scores ``qk [M, N]`` and values ``v [N, D]`` into the state."""
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc += tl.dot(p.to(COMPUTE_DTYPE), v.to(COMPUTE_DTYPE), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_attention_kernel(
    q_ptr,  # [T, Hq, D]
    stride_qt,
    stride_qh,
    stride_qd,
    k_ptr,  # [T, Hkv, D] new tokens
    stride_kt,
    stride_kh,
    stride_kd,
    v_ptr,  # [T, Hkv, D] new tokens
    stride_vt,
    stride_vh,
    stride_vd,
    kc_ptr,  # [num_blocks, BS, Hkv, D] paged prefix
    stride_kcb,
    stride_kcr,
    stride_kch,
    stride_kcd,
    vc_ptr,  # [num_blocks, BS, Hkv, D] paged prefix
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
    cu_ptr,  # [B + 1] int32
    prefix_ptr,  # [B] int32
    out_ptr,  # [T, Hq, D]
    stride_ot,
    stride_oh,
    stride_od,
    qk_scale,  # softmax_scale * log2(e)
    GROUP: tl.constexpr,  # q heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block (page) size
    IS_FP8: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: do all arithmetic in fp32
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    # Longest-running (last) query blocks first: better tail behaviour for causal work.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)

    seq_start = tl.load(cu_ptr + seq).to(tl.int64)
    new_len = tl.load(cu_ptr + seq + 1) - tl.load(cu_ptr + seq)
    m0 = m_block * BLOCK_M
    if m0 >= new_len:
        return
    prefix_len = tl.load(prefix_ptr + seq)
    kv_head = head // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)  # [M] positions among the new tokens
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < new_len
    d_ok = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr
        + (seq_start + offs_m[:, None]) * stride_qt
        + head * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)
    compute_dtype = q.dtype

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # ---- 1. the paged prefix: every prefix key is visible to every new query --------------
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
    kc_head = kc_ptr + kv_head * stride_kch
    vc_head = vc_ptr + kv_head * stride_vch
    for n0 in range(0, prefix_len, BLOCK_N):
        tok = n0 + offs_n  # [N] absolute positions
        tok_ok = tok < prefix_len
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
        # fp8 values are exact in fp16/bf16/fp32: K enters the dot unscaled and its per-page
        # scale multiplies the fp32 scores.
        qk = tl.dot(q, tl.trans(k.to(compute_dtype)), input_precision=DOT_PRECISION)
        if IS_FP8:
            k_scale = tl.load(
                ks_ptr + page * stride_ksb + kv_head * stride_ksh, mask=tok_ok, other=0.0
            )
            qk = qk * (k_scale * qk_scale)[None, :]
            # V dequantised elementwise: folding its scale into p could underflow fp16.
            v_scale = tl.load(
                vs_ptr + page * stride_vsb + kv_head * stride_vsh, mask=tok_ok, other=0.0
            )
            v = v.to(tl.float32) * v_scale[:, None]
        else:
            qk = qk * qk_scale
        qk = tl.where(tok_ok[None, :], qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, compute_dtype, DOT_PRECISION)

    # ---- 2. new keys strictly before this query block: no mask needed ----------------------
    # (BLOCK_M is a multiple of BLOCK_N, so these tiles end at m0 <= new_len.)
    k_new = k_ptr + seq_start * stride_kt + kv_head * stride_kh
    v_new = v_ptr + seq_start * stride_vt + kv_head * stride_vh
    for n0 in range(0, m0, BLOCK_N):
        tok = n0 + offs_n
        k = tl.load(
            k_new + tok[:, None] * stride_kt + offs_d[None, :] * stride_kd,
            mask=d_ok[None, :],
            other=0.0,
        )
        v = tl.load(
            v_new + tok[:, None] * stride_vt + offs_d[None, :] * stride_vd,
            mask=d_ok[None, :],
            other=0.0,
        )
        qk = tl.dot(q, tl.trans(k.to(compute_dtype)), input_precision=DOT_PRECISION) * qk_scale
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, compute_dtype, DOT_PRECISION)

    # ---- 3. the diagonal tiles: causal + sequence-end mask ---------------------------------
    # Every query row of the block sees key m0 (m0 < new_len), so no row is ever all -inf.
    for n0 in range(m0, tl.minimum(m0 + BLOCK_M, new_len), BLOCK_N):
        tok = n0 + offs_n
        tok_ok = tok < new_len
        kv_mask = tok_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_new + tok[:, None] * stride_kt + offs_d[None, :] * stride_kd,
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_new + tok[:, None] * stride_vt + offs_d[None, :] * stride_vd,
            mask=kv_mask,
            other=0.0,
        )
        qk = tl.dot(q, tl.trans(k.to(compute_dtype)), input_precision=DOT_PRECISION) * qk_scale
        visible = (tok[None, :] <= offs_m[:, None]) & tok_ok[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, compute_dtype, DOT_PRECISION)

    out = acc / l_i[:, None]
    if ROUND_BF16:
        out = round_to_bf16_grid(out)
    tl.store(
        out_ptr
        + (seq_start + offs_m[:, None]) * stride_ot
        + head * stride_oh
        + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )


def _check_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prefix_lens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            "q must be [T, num_q_heads, head_dim] and k, v [T, num_kv_heads, head_dim], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k, v must share a float32/float16/bfloat16 dtype, got {q.dtype}, {k.dtype}, "
            f"{v.dtype}"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    num_kv_heads = k.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} not a multiple of num_kv_heads {num_kv_heads}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens must be int32 [B+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    batch = cu_seqlens.numel() - 1
    if prefix_lens.shape != (batch,) or prefix_lens.dtype != torch.int32:
        raise ValueError(
            f"prefix_lens must be int32 [B={batch}], got {prefix_lens.dtype} "
            f"{tuple(prefix_lens.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache heads/head_dim {tuple(k_cache.shape[2:])} != {(num_kv_heads, head_dim)}"
        )
    block_size = k_cache.shape[1]
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


def prefill_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prefix_lens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    softmax_scale: float,
    max_new_len: int | None = None,
) -> torch.Tensor:
    """Torch reference (and CPU production path): per sequence, fp32, one masked softmax."""
    _check_args(q, k, v, cu_seqlens, prefix_lens, k_cache, v_cache, k_scale, v_scale, block_tables)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    block_size = k_cache.shape[1]
    fp8 = k_cache.dtype == FP8_DTYPE
    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    prefixes = prefix_lens.tolist()
    tables = block_tables.long()

    def gather(cache: torch.Tensor, scale: torch.Tensor | None, pages: torch.Tensor, n: int):
        x = cache.index_select(0, pages).float()  # [P, BS, Hkv, D]; faster than cache[pages] on CPU
        if fp8:
            x = x * scale.index_select(0, pages)[:, None, :, None]
        return x.reshape(-1, num_kv_heads, head_dim)[:n]  # [n, Hkv, D]

    for b in range(len(prefixes)):
        start, end, prefix = cu[b], cu[b + 1], prefixes[b]
        new_len = end - start
        if new_len == 0:
            continue
        pages = tables[b, : triton.cdiv(prefix, block_size)]
        keys = torch.cat([gather(k_cache, k_scale, pages, prefix), k[start:end].float()])
        values = torch.cat([gather(v_cache, v_scale, pages, prefix), v[start:end].float()])
        keys = keys.repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = values.repeat_interleave(group, dim=1)  # [S, Hq, D]
        scores = torch.einsum("ihd,jhd->hij", q[start:end].float(), keys) * softmax_scale
        # New token i (absolute position prefix + i) sees keys j <= prefix + i.
        i = torch.arange(new_len, device=q.device)[:, None]
        j = torch.arange(prefix + new_len, device=q.device)[None, :]
        scores = scores.masked_fill(j > prefix + i, float("-inf"))  # [Hq, new, S]
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hij,jhd->ihd", probs, values).to(q.dtype)
    return out


def _launch_config(head_dim: int, interpret: bool) -> dict[str, int]:
    if interpret:
        # Small tiles so that short test sequences still cross several query/key tiles.
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if head_dim <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}


def prefill_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prefix_lens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    softmax_scale: float,
    max_new_len: int | None = None,
) -> torch.Tensor:
    """Triton path. ``max_new_len`` (an upper bound is fine) sizes the grid; pass it to avoid
    a device -> host sync on ``cu_seqlens``."""
    _check_args(q, k, v, cu_seqlens, prefix_lens, k_cache, v_cache, k_scale, v_scale, block_tables)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    batch = cu_seqlens.numel() - 1
    out = torch.empty_like(q)
    if batch == 0 or num_tokens == 0:
        return out
    if max_new_len is None:
        max_new_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if max_new_len <= 0:
        return out

    fp8 = k_cache.dtype == FP8_DTYPE
    interpret = dispatch.interpreter_active()
    dummy_scale = torch.empty((1, 1), dtype=torch.float32, device=q.device)
    ks = k_scale if fp8 else dummy_scale
    vs = v_scale if fp8 else dummy_scale
    # The kernel indexes these with unit strides along their last dimension.
    cu_seqlens, prefix_lens = cu_seqlens.contiguous(), prefix_lens.contiguous()
    block_tables = block_tables.contiguous()
    cfg = _launch_config(head_dim, interpret)
    block_m = cfg.pop("BLOCK_M")
    grid = (triton.cdiv(max_new_len, block_m), num_q_heads, batch)
    _prefill_attention_kernel[grid](
        q,
        *q.stride(),
        k,
        *k.stride(),
        v,
        *v.stride(),
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
        cu_seqlens,
        prefix_lens,
        out,
        *out.stride(),
        softmax_scale * _LOG2E,
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_SIZE=k_cache.shape[1],
        IS_FP8=fp8,
        UPCAST=interpret,
        DOT_PRECISION="ieee" if (interpret or q.dtype == torch.float32) else "tf32",
        ROUND_BF16=interpret and q.dtype == torch.bfloat16,
        **cfg,
    )
    return out


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prefix_lens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    softmax_scale: float,
    max_new_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over (paged prefix + new tokens); ``[T, Hq, D]`` out."""
    fn = prefill_attention_triton if dispatch.use_triton(q) else prefill_attention_reference
    return fn(
        q,
        k,
        v,
        cu_seqlens,
        prefix_lens,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables,
        softmax_scale,
        max_new_len,
    )
