"""FP8 e4m3 codec for whole KV blocks, used by the KV transfer between prefill and decode.

A block tensor is ``[n, block_size, num_kv_heads, head_dim]``. Quantisation uses the shared
convention of :mod:`engine.kernels.fp8`: one float32 scale per (block, kv head),
``scale = max(amax, 1e-12) / 448`` and ``dequantised = fp8.float() * scale``.

The Triton kernels run one program per (block, kv head) and hold the whole
``[block_size, head_dim]`` tile in registers: a block is small (16 x 128 by default), so the
amax reduction and the quantisation need a single pass over HBM. On CPU a C kernel
(``kv_codec_cpu.c``, built on first use) does the same per block, bit for bit the torch
reference, which remains where no C compiler is at hand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import cpu_native, dispatch
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

# Module-level constants are visible to jit functions only as tl.constexpr globals.
FP8_MAX_C = tl.constexpr(FP8_MAX)
FP8_MIN_AMAX_C = tl.constexpr(FP8_MIN_AMAX)


@triton.jit
def _quantize_kv_blocks_kernel(
    x_ptr,  # [n, BS, H, D] any float dtype
    stride_xn,
    stride_xr,
    stride_xh,
    stride_xd,
    q_ptr,  # [n, BS, H, D] float8_e4m3fn
    stride_qn,
    stride_qr,
    stride_qh,
    stride_qd,
    scale_ptr,  # [n, H] float32
    stride_sn,
    stride_sh,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_r[:, None] < BLOCK_SIZE) & (offs_d[None, :] < HEAD_DIM)

    x_ptrs = (
        x_ptr
        + blk * stride_xn
        + head * stride_xh
        + offs_r[:, None] * stride_xr
        + offs_d[None, :] * stride_xd
    )
    # Convert to fp32 first: exact for every input dtype, and the interpreter cannot do bf16
    # arithmetic.
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BS, D]

    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    # div_rn: IEEE division, so the scale and the quantised values match torch bit for bit on
    # GPUs too (Triton's default fp32 division is approximate there).
    scale = tl.math.div_rn(tl.maximum(amax, FP8_MIN_AMAX_C), FP8_MAX_C)
    q = round_to_e4m3_grid(tl.math.div_rn(x, scale))

    q_ptrs = (
        q_ptr
        + blk * stride_qn
        + head * stride_qh
        + offs_r[:, None] * stride_qr
        + offs_d[None, :] * stride_qd
    )
    tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + blk * stride_sn + head * stride_sh, scale)


@triton.jit
def _dequantize_kv_blocks_kernel(
    q_ptr,  # [n, BS, H, D] float8_e4m3fn
    stride_qn,
    stride_qr,
    stride_qh,
    stride_qd,
    scale_ptr,  # [n, H] float32
    stride_sn,
    stride_sh,
    out_ptr,  # [n, BS, H, D] out dtype
    stride_on,
    stride_or,
    stride_oh,
    stride_od,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_r[:, None] < BLOCK_SIZE) & (offs_d[None, :] < HEAD_DIM)

    scale = tl.load(scale_ptr + blk * stride_sn + head * stride_sh)
    q_ptrs = (
        q_ptr
        + blk * stride_qn
        + head * stride_qh
        + offs_r[:, None] * stride_qr
        + offs_d[None, :] * stride_qd
    )
    x = tl.load(q_ptrs, mask=mask, other=0.0).to(tl.float32) * scale  # [BS, D]
    if ROUND_BF16:
        # The interpreter's fp32 -> bf16 cast truncates; round to nearest even first.
        x = round_to_bf16_grid(x)
    out_ptrs = (
        out_ptr
        + blk * stride_on
        + head * stride_oh
        + offs_r[:, None] * stride_or
        + offs_d[None, :] * stride_od
    )
    tl.store(out_ptrs, x.to(out_ptr.dtype.element_ty), mask=mask)


def _check_blocks(x: torch.Tensor, name: str) -> None:
    if x.dim() != 4:
        raise ValueError(
            f"{name} must be [n, block_size, num_kv_heads, head_dim], got shape {tuple(x.shape)}"
        )


# ---------------------------------------------------------------------------------------------
# quantize
# ---------------------------------------------------------------------------------------------


def quantize_kv_blocks_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: x [n, BS, H, D] -> (fp8 [n, BS, H, D], scale [n, H] float32)."""
    _check_blocks(x, "x")
    amax = x.float().abs().amax(dim=(1, 3))  # [n, H]
    scale = scale_from_amax(amax)  # [n, H]
    q = quantize_reference(x, scale[:, None, :, None])
    return q, scale


def quantize_kv_blocks_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel: one program per (block, kv head)."""
    _check_blocks(x, "x")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    n, block_size, num_heads, head_dim = x.shape
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((n, num_heads), dtype=torch.float32, device=x.device)
    if n == 0:
        return q, scale
    _quantize_kv_blocks_kernel[(n, num_heads)](
        x,
        *x.stride(),
        q,
        *q.stride(),
        scale,
        *scale.stride(),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
    return q, scale


def quantize_kv_blocks_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C kernel (engine.kernels.cpu_native): one pass per block, at memory speed."""
    _check_blocks(x, "x")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be float32/float16/bfloat16, got {x.dtype}")
    x = x.contiguous()
    n, block_size, num_heads, head_dim = x.shape
    q = torch.empty(x.shape, dtype=FP8_DTYPE)
    scale = torch.empty((n, num_heads), dtype=torch.float32)
    cpu_native.library().quantize_kv_blocks(
        x.data_ptr(), cpu_native.C_DTYPES[x.dtype], n, block_size, num_heads, head_dim,
        q.data_ptr(), scale.data_ptr(),
    )  # fmt: skip
    return q, scale


def quantize_kv_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise whole KV blocks to fp8 e4m3 with one scale per (block, kv head)."""
    if dispatch.use_triton(x):
        return quantize_kv_blocks_triton(x)
    if x.device.type == "cpu" and cpu_native.library() is not None:
        return quantize_kv_blocks_cpu(x)
    return quantize_kv_blocks_reference(x)


# ---------------------------------------------------------------------------------------------
# dequantize
# ---------------------------------------------------------------------------------------------


def _check_dequant_args(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    _check_blocks(q, "q_fp8")
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"q_fp8 must be {FP8_DTYPE}, got {q.dtype}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"scale must be float32 [n, num_kv_heads] = {(q.shape[0], q.shape[2])}, "
            f"got {scale.dtype} {tuple(scale.shape)}"
        )
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be float32/float16/bfloat16, got {dtype}")


def dequantize_kv_blocks_reference(
    q_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Torch reference: fp8 [n, BS, H, D] * scale [n, H] -> dtype [n, BS, H, D]."""
    _check_dequant_args(q_fp8, scale, dtype)
    return (q_fp8.float() * scale[:, None, :, None]).to(dtype)


def dequantize_kv_blocks_triton(
    q_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Triton kernel: one program per (block, kv head)."""
    _check_dequant_args(q_fp8, scale, dtype)
    n, block_size, num_heads, head_dim = q_fp8.shape
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    out = torch.empty(q_fp8.shape, dtype=dtype, device=q_fp8.device)
    if n == 0:
        return out
    _dequantize_kv_blocks_kernel[(n, num_heads)](
        q_fp8,
        *q_fp8.stride(),
        scale,
        *scale.stride(),
        out,
        *out.stride(),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        ROUND_BF16=dispatch.interpreter_active() and dtype == torch.bfloat16,
        num_warps=4,
    )
    return out


def dequantize_kv_blocks_cpu(
    q_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The C kernel (engine.kernels.cpu_native)."""
    _check_dequant_args(q_fp8, scale, dtype)
    q_fp8, scale = q_fp8.contiguous(), scale.contiguous()
    n, block_size, num_heads, head_dim = q_fp8.shape
    out = torch.empty(q_fp8.shape, dtype=dtype)
    cpu_native.library().dequantize_kv_blocks(
        q_fp8.data_ptr(), scale.data_ptr(), n, block_size, num_heads, head_dim,
        out.data_ptr(), cpu_native.C_DTYPES[dtype],
    )  # fmt: skip
    return out


def dequantize_kv_blocks(
    q_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Dequantise fp8 KV blocks: ``q_fp8.float() * scale`` cast to ``dtype``."""
    if dispatch.use_triton(q_fp8):
        return dequantize_kv_blocks_triton(q_fp8, scale, dtype)
    if q_fp8.device.type == "cpu" and cpu_native.library() is not None:
        return dequantize_kv_blocks_cpu(q_fp8, scale, dtype)
    return dequantize_kv_blocks_reference(q_fp8, scale, dtype)
