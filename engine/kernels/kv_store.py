"""Writes the K/V of new tokens into the paged KV cache of one layer.

Cache layout: ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``. Token
``t`` goes to ``slot_mapping[t] = block_id * block_size + row``; a negative slot means "do not
store" (padding tokens).

Non-fp8 caches use a plain scatter kernel (one program per token, all heads at once).

FP8 caches carry one float32 scale per (block, kv head) (see :mod:`engine.kernels.fp8`), so
they are written per *run*: ``block_runs`` int32 ``[R, 4]`` rows of
``(block_id, first_row, src_token_start, count)``. One program per (run, kv head) loads the
whole ``[block_size, head_dim]`` tile:

* ``first_row == 0``: the block is fresh; ``scale = scale_from_amax(amax(new rows))``.
* otherwise ``scale = max(old_scale, scale_from_amax(amax(new rows)))``; if the scale grew, the
  rows already there (``[0, first_row)``) are requantised with it.

New rows are quantised with the (new) scale; rows past ``first_row + count`` are left alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_AMAX,
    quantize_reference,
    round_to_bf16_grid,
    round_to_e4m3_grid,
    scale_from_amax,
)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CACHE_DTYPES = (*_FLOAT_DTYPES, FP8_DTYPE)

# Module-level constants are visible to jit functions only as tl.constexpr globals.
FP8_MAX_C = tl.constexpr(FP8_MAX)
FP8_MIN_AMAX_C = tl.constexpr(FP8_MIN_AMAX)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_scatter_kernel(
    k_ptr,  # [T, H, D]
    stride_kt,
    stride_kh,
    stride_kd,
    v_ptr,  # [T, H, D]
    stride_vt,
    stride_vh,
    stride_vd,
    kc_ptr,  # [num_blocks, BS, H, D]
    stride_kcb,
    stride_kcr,
    stride_kch,
    stride_kcd,
    vc_ptr,  # [num_blocks, BS, H, D]
    stride_vcb,
    stride_vcr,
    stride_vch,
    stride_vcd,
    slot_ptr,  # [T] int64
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    blk = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(
        k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
    )  # [H, D]
    v = tl.load(
        v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
    )  # [H, D]
    if UPCAST:
        # Interpreter only: its bf16 handling is unreliable, so convert through fp32.
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if ROUND_BF16:
        # Interpreter only: its fp32 -> bf16 cast truncates, so round to nearest even first.
        k = round_to_bf16_grid(k)
        v = round_to_bf16_grid(v)
    kc = kc_ptr + blk * stride_kcb + row * stride_kcr
    vc = vc_ptr + blk * stride_vcb + row * stride_vcr
    tl.store(
        kc + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
        k.to(kc_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        vc + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
        v.to(vc_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _store_block_fp8(
    src_ptr,  # [T, H, D] new tokens
    stride_st,
    stride_sd,
    cache_ptr,  # [num_blocks, BS, H, D] fp8
    stride_cr,
    stride_cd,
    scale_ptr,  # scalar address of this (block, head)'s scale
    offs_r,  # [BS] rows of the block
    offs_d,  # [BLOCK_D]
    first_row,
    count,
    src_start,
    HEAD_DIM: tl.constexpr,
):
    """Merges ``count`` new rows into one (block, head) fp8 tile, updating its scale."""
    d_ok = offs_d[None, :] < HEAD_DIM
    is_new = (offs_r >= first_row) & (offs_r < first_row + count)  # [BS]

    src_rows = (src_start + offs_r - first_row).to(tl.int64)
    x = tl.load(
        src_ptr + src_rows[:, None] * stride_st + offs_d[None, :] * stride_sd,
        mask=is_new[:, None] & d_ok,
        other=0.0,
    ).to(tl.float32)  # [BS, D]
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    # div_rn: IEEE division, bit-identical to torch's (Triton's default fp32 division is
    # approximate on GPUs).
    new_rows_scale = tl.math.div_rn(tl.maximum(amax, FP8_MIN_AMAX_C), FP8_MAX_C)

    # A fresh block (first_row == 0) ignores whatever scale the slot held before.
    old_scale = tl.load(scale_ptr, mask=first_row > 0, other=0.0)
    scale = tl.maximum(old_scale, new_rows_scale)
    grew = scale > old_scale

    tile_ptrs = cache_ptr + offs_r[:, None] * stride_cr + offs_d[None, :] * stride_cd
    # Requantise the rows already in the block if the scale grew (otherwise they stay as is).
    requant = (offs_r[:, None] < tl.where(grew, first_row, 0)) & d_ok
    old = tl.load(tile_ptrs, mask=requant, other=0.0).to(tl.float32) * old_scale
    old_q = round_to_e4m3_grid(tl.math.div_rn(old, scale))
    tl.store(tile_ptrs, old_q.to(cache_ptr.dtype.element_ty), mask=requant)

    new_q = round_to_e4m3_grid(tl.math.div_rn(x, scale))
    tl.store(tile_ptrs, new_q.to(cache_ptr.dtype.element_ty), mask=is_new[:, None] & d_ok)
    tl.store(scale_ptr, scale)


@triton.jit
def _store_kv_fp8_kernel(
    k_ptr,  # [T, H, D]
    stride_kt,
    stride_kh,
    stride_kd,
    v_ptr,  # [T, H, D]
    stride_vt,
    stride_vh,
    stride_vd,
    kc_ptr,  # [num_blocks, BS, H, D] fp8
    stride_kcb,
    stride_kcr,
    stride_kch,
    stride_kcd,
    vc_ptr,  # [num_blocks, BS, H, D] fp8
    stride_vcb,
    stride_vcr,
    stride_vch,
    stride_vcd,
    ks_ptr,  # [num_blocks, H] float32
    stride_ksb,
    stride_ksh,
    vs_ptr,  # [num_blocks, H] float32
    stride_vsb,
    stride_vsh,
    runs_ptr,  # [R, 4] int32: (block_id, first_row, src_token_start, count)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    run = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    blk = tl.load(runs_ptr + run * 4 + 0).to(tl.int64)
    first_row = tl.load(runs_ptr + run * 4 + 1)
    src_start = tl.load(runs_ptr + run * 4 + 2)
    count = tl.load(runs_ptr + run * 4 + 3)

    offs_r = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    _store_block_fp8(
        k_ptr + head * stride_kh,
        stride_kt,
        stride_kd,
        kc_ptr + blk * stride_kcb + head * stride_kch,
        stride_kcr,
        stride_kcd,
        ks_ptr + blk * stride_ksb + head * stride_ksh,
        offs_r,
        offs_d,
        first_row,
        count,
        src_start,
        HEAD_DIM,
    )
    _store_block_fp8(
        v_ptr + head * stride_vh,
        stride_vt,
        stride_vd,
        vc_ptr + blk * stride_vcb + head * stride_vch,
        stride_vcr,
        stride_vcd,
        vs_ptr + blk * stride_vsb + head * stride_vsh,
        offs_r,
        offs_d,
        first_row,
        count,
        src_start,
        HEAD_DIM,
    )


# ---------------------------------------------------------------------------------------------
# Host helpers
# ---------------------------------------------------------------------------------------------


def block_runs_from_slots(slot_mapping_cpu: torch.Tensor, block_size: int) -> torch.Tensor:
    """Groups a slot mapping into per-block runs for fp8 stores.

    Returns int32 ``[R, 4]`` rows of ``(block_id, first_row, src_token_start, count)``: maximal
    stretches of consecutive tokens that land on consecutive rows of one block. Negative slots
    (padding) are skipped. Raises ValueError if one block would get two runs (two programs
    would then race on its scale).
    """
    if slot_mapping_cpu.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D, got shape {tuple(slot_mapping_cpu.shape)}")
    slots = slot_mapping_cpu.to(device="cpu", dtype=torch.int64)
    src = torch.nonzero(slots >= 0).flatten()  # [N] token indices that are stored
    slots = slots[src]
    if slots.numel() == 0:
        return torch.empty((0, 4), dtype=torch.int32)
    blocks = slots // block_size
    rows = slots % block_size

    starts_run = torch.ones_like(slots, dtype=torch.bool)
    starts_run[1:] = (
        (blocks[1:] != blocks[:-1]) | (rows[1:] != rows[:-1] + 1) | (src[1:] != src[:-1] + 1)
    )
    first = torch.nonzero(starts_run).flatten()  # [R]
    counts = torch.diff(first, append=torch.tensor([slots.numel()]))
    runs = torch.stack([blocks[first], rows[first], src[first], counts], dim=1)
    if torch.unique(runs[:, 0]).numel() != runs.shape[0]:
        raise ValueError(
            "slot_mapping writes one block in several non-contiguous runs; fp8 stores need "
            "each block's new rows to be consecutive tokens on consecutive rows"
        )
    return runs.to(torch.int32)


def _check_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"k and v must both be [T, num_kv_heads, head_dim], got {tuple(k.shape)} and "
            f"{tuple(v.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"cache heads/head_dim {tuple(k_cache.shape[2:])} do not match k {tuple(k.shape[1:])}"
        )
    if k.dtype not in _FLOAT_DTYPES or v.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"k/v must be float32/float16/bfloat16, got {k.dtype}/{v.dtype}")
    if k_cache.dtype not in _CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache/v_cache must share a dtype among {_CACHE_DTYPES}, got "
            f"{k_cache.dtype}/{v_cache.dtype}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping must be [T] = [{k.shape[0]}], got shape {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")
    block_size = k_cache.shape[1]
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 8, got {block_size}")
    if k_cache.dtype == FP8_DTYPE:
        expected = (k_cache.shape[0], k_cache.shape[2])
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None or s.dtype != torch.float32 or tuple(s.shape) != expected:
                raise ValueError(
                    f"fp8 caches need {name} float32 [num_blocks, num_kv_heads] = {expected}, got "
                    f"{None if s is None else (s.dtype, tuple(s.shape))}"
                )


def _check_runs(block_runs: torch.Tensor) -> None:
    if block_runs.dim() != 2 or block_runs.shape[1] != 4 or block_runs.dtype != torch.int32:
        raise ValueError(
            f"block_runs must be int32 [R, 4], got {block_runs.dtype} {tuple(block_runs.shape)}"
        )


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def _store_fp8_reference(
    x: torch.Tensor,  # [T, H, D]
    cache: torch.Tensor,  # [num_blocks, BS, H, D] fp8
    scale: torch.Tensor,  # [num_blocks, H]
    runs: torch.Tensor,  # [R, 4] int64 (on x's device)
) -> None:
    block_size = cache.shape[1]
    blocks, first_row, src_start, count = runs.unbind(dim=1)  # [R] each
    rows = torch.arange(block_size, device=x.device)  # [BS]
    is_new = (rows[None] >= first_row[:, None]) & (rows[None] < (first_row + count)[:, None])
    is_old = rows[None] < first_row[:, None]  # [R, BS]
    src = (src_start[:, None] + rows[None] - first_row[:, None]).clamp(0, max(x.shape[0] - 1, 0))

    new = torch.where(is_new[:, :, None, None], x[src].float(), 0.0)  # [R, BS, H, D]
    new_rows_scale = scale_from_amax(new.abs().amax(dim=(1, 3)))  # [R, H]
    old_scale = torch.where(first_row[:, None] > 0, scale[blocks], 0.0)  # [R, H]
    new_scale = torch.maximum(old_scale, new_rows_scale)  # [R, H]
    grew = new_scale > old_scale  # [R, H]

    tile = cache.view(torch.uint8)[blocks].view(FP8_DTYPE)  # [R, BS, H, D]
    requant = quantize_reference(
        tile.float() * old_scale[:, None, :, None], new_scale[:, None, :, None]
    )
    do_requant = is_old[:, :, None, None] & grew[:, None, :, None]  # [R, BS, H, 1]
    # torch.where has no fp8 kernel on every backend: select on the raw bytes.
    out = torch.where(do_requant, requant.view(torch.uint8), tile.view(torch.uint8))
    new_q = quantize_reference(new, new_scale[:, None, :, None]).view(torch.uint8)
    out = torch.where(is_new[:, :, None, None], new_q, out)
    cache.view(torch.uint8)[blocks] = out
    scale[blocks] = new_scale


def store_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    block_runs: torch.Tensor | None = None,
) -> None:
    """Torch reference (and CPU production path) of :func:`store_kv`; writes in place."""
    _check_args(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    block_size = k_cache.shape[1]
    if k_cache.dtype != FP8_DTYPE:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        num_heads, head_dim = k_cache.shape[2:]
        k_cache.view(-1, num_heads, head_dim)[slots] = k[keep].to(k_cache.dtype)
        v_cache.view(-1, num_heads, head_dim)[slots] = v[keep].to(v_cache.dtype)
        return
    if block_runs is None:
        block_runs = block_runs_from_slots(slot_mapping.cpu(), block_size)
    _check_runs(block_runs)
    if block_runs.shape[0] == 0:
        return
    runs = block_runs.to(device=k.device, dtype=torch.int64)
    _store_fp8_reference(k, k_cache, k_scale, runs)
    _store_fp8_reference(v, v_cache, v_scale, runs)


# ---------------------------------------------------------------------------------------------
# Triton wrapper and dispatcher
# ---------------------------------------------------------------------------------------------


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    block_runs: torch.Tensor | None = None,
) -> None:
    """Triton path of :func:`store_kv`; writes in place."""
    _check_args(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    num_tokens, num_heads, head_dim = k.shape
    block_size = k_cache.shape[1]
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    if k_cache.dtype != FP8_DTYPE:
        round_bf16 = dispatch.interpreter_active() and k_cache.dtype == torch.bfloat16
        _store_kv_scatter_kernel[(num_tokens,)](
            k,
            *k.stride(),
            v,
            *v.stride(),
            k_cache,
            *k_cache.stride(),
            v_cache,
            *v_cache.stride(),
            slot_mapping.contiguous(),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_D=block_d,
            BLOCK_SIZE=block_size,
            UPCAST=dispatch.interpreter_active(),
            ROUND_BF16=round_bf16,
            num_warps=4 if num_heads * block_d >= 1024 else 1,
        )
        return

    if block_runs is None:
        # Costs a device -> host sync; the model runner should pass precomputed runs.
        block_runs = block_runs_from_slots(slot_mapping.cpu(), block_size)
    _check_runs(block_runs)
    block_runs = block_runs.to(k.device)
    if block_runs.shape[0] == 0:
        return
    _store_kv_fp8_kernel[(block_runs.shape[0], num_heads)](
        k,
        *k.stride(),
        v,
        *v.stride(),
        k_cache,
        *k_cache.stride(),
        v_cache,
        *v_cache.stride(),
        k_scale,
        *k_scale.stride(),
        v_scale,
        *v_scale.stride(),
        block_runs.contiguous(),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        num_warps=4,
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    block_runs: torch.Tensor | None = None,
) -> None:
    """Writes new tokens' K/V ``[T, Hkv, D]`` into the paged cache (in place).

    ``slot_mapping`` int64 ``[T]`` holds ``block_id * block_size + row`` (negative: skip). FP8
    caches are written per block run (see module docstring); ``block_runs`` is built from the
    slot mapping when not given.
    """
    if dispatch.use_triton(k):
        store_kv_triton(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, block_runs)
    elif k_cache.dtype != FP8_DTYPE and k_cache.device.type == "cpu":
        store_kv_cpu(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_reference(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, block_runs)


def store_kv_cpu(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The CPU path for bf16/fp16/fp32 caches: one index_copy_ per cache, the reference's
    boolean masks only when some slot is negative (skipped)."""
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        store_kv_reference(k, v, k_cache, v_cache, None, None, slot_mapping)
        return
    num_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
