"""RMSNorm with an optional fused residual add, with Hugging Face LlamaRMSNorm semantics.

HF computes, in this order::

    hidden = residual + hidden                      # model dtype (decoder layer)
    h = hidden.to(float32)
    h = h * rsqrt(mean(h**2, -1) + eps)
    out = weight * h.to(input_dtype)                # rounded to the input dtype first

The kernel reproduces each rounding point (residual sum in the input dtype, normalised
value rounded to the input dtype before the weight multiply) so it differs from the
reference only by fp32 reduction order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import dispatch
from engine.kernels.fused_cpu import rmsnorm_native
from engine.kernels.silu_mul import cast_rne

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    stride_xm,
    stride_rm,
    stride_om,
    stride_nm,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One program per row; the whole row lives in registers, so x is read once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    mask = cols < H
    x_dtype = x_ptr.dtype.element_ty

    h = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_rm + cols, mask=mask, other=0.0).to(tl.float32)
        # HF adds in the model dtype; fp32 add + one rounding is what torch does too.
        summed = cast_rne(h + r, x_dtype, INTERPRET)
        tl.store(new_residual_ptr + row * stride_nm + cols, summed, mask=mask)
        h = summed.to(tl.float32)

    # Masked lanes are 0, so they add nothing to the sum; divide by the true H.
    variance = tl.sum(h * h, axis=0) / H
    # Correctly rounded sqrt and divide (the defaults are approximate on GPUs), as torch's
    # CPU rsqrt is: one scalar per row, so the cost is nil.
    rstd = tl.div_rn(1.0, tl.sqrt_rn(variance + eps))
    normed = cast_rne(h * rstd, x_dtype, INTERPRET).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # An fp32 product of two 16-bit floats is exact, so one rounding matches torch's.
    out = cast_rne(w * normed, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + row * stride_om + cols, out, mask=mask)


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"rmsnorm: x must be 2-D [M, H], got shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"rmsnorm: weight must be 1-D [H={x.shape[1]}], got shape {tuple(weight.shape)}"
        )
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"rmsnorm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}"
            )
        if residual.dtype != x.dtype:
            raise ValueError(f"rmsnorm: residual dtype {residual.dtype} != x dtype {x.dtype}")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"rmsnorm: unsupported {name} dtype {t.dtype}")


def rmsnorm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm. Returns ``out``, or ``(out, x + residual)`` when ``residual`` is given."""
    _check_inputs(x, weight, residual)
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    weight = weight.contiguous()

    m, h = x.shape
    # weight * h.to(x.dtype) promotes like torch does (an fp32 weight gives an fp32 output).
    out = torch.empty((m, h), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = (
        torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    )
    if m > 0 and h > 0:
        block_h = triton.next_power_of_2(h)
        # Enough threads that each holds at most ~16 fp32 values of the row.
        num_warps = min(max(block_h // 512, 1), 16)
        _rmsnorm_kernel[(m,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            new_residual if new_residual is not None else out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            new_residual.stride(0) if new_residual is not None else 0,
            h,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            INTERPRET=dispatch.interpreter_active(),
            BLOCK_H=block_h,
            num_warps=num_warps,
        )
    if new_residual is not None:
        return out, new_residual
    return out


def rmsnorm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain torch (the CPU production path), bit-identical to HF's LlamaRMSNorm.

    Works on any leading shape; the last dimension is normalised.
    """
    if residual is not None:
        x = residual + x
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    # In place on the small [.., 1] tensor only: same values as HF, one allocation fewer.
    h = h * variance.add_(eps).rsqrt_()
    out = weight * h.to(input_dtype)
    if residual is not None:
        return out, x
    return out


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) or, with ``residual``, ``(RMSNorm(x + residual), x + residual)``.

    Triton on CUDA tensors; on CPU the C kernel (fused_cpu: one pass, where torch's fp32
    op costs ~100 us a call at decode's one row), else torch's fused op in fp32 and the torch
    reference in other dtypes.
    """
    if dispatch.use_triton(x):
        return rmsnorm_triton(x, weight, eps, residual)
    fused = rmsnorm_native(x, weight, eps, residual)
    if fused is not None:
        return fused
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return rmsnorm_cpu(x, weight, eps, residual)
    return rmsnorm_reference(x, weight, eps, residual)


def rmsnorm_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fp32 on CPU: torch's fused RMSNorm (the same values as the reference in fp32, one
    kernel instead of seven)."""
    if residual is not None:
        x = residual + x
    out = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return (out, x) if residual is not None else out
