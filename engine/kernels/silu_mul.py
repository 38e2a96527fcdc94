"""SiLU-and-multiply for the Llama MLP: ``silu(gate) * up`` from a fused gate_up tensor.

Hugging Face computes ``act_fn(gate_proj(x)) * up_proj(x)`` in the model dtype, so the SiLU
result is rounded to that dtype before the product, and the product is rounded again. The
kernel keeps both rounding points (doing the arithmetic itself in fp32), so on a GPU it
agrees with the reference to within fp32 evaluation-order noise.

This module also holds the small ``@triton.jit`` helpers that the GEMM epilogue in
``fused_linear`` and the RMSNorm kernel share: ``cast_rne`` and ``silu_mul_math``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels import dispatch

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Cast fp32 ``x`` to ``DTYPE`` with round-to-nearest-even.

    The interpreter's fp32 -> bf16 cast truncates the mantissa instead of rounding, so
    under the interpreter we first round the fp32 bit pattern onto the bf16 grid (keep
    16 bits, add half an ulp plus the lowest kept bit for ties-to-even); the cast that
    follows is then exact. Compiled kernels round correctly on their own.
    """
    if INTERPRET:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def silu_mul_math(gate, up, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """``silu(gate) * up`` on fp32 tiles that already hold ``DTYPE`` values.

    Rounds the SiLU to ``DTYPE`` before the product, as the model-dtype torch ops do.
    Returns a ``DTYPE`` tile.
    """
    # torch evaluates silu as x / (1 + exp(-x)); the same form keeps us closest to it.
    silu = gate / (1.0 + tl.exp(-gate))
    silu = cast_rne(silu, DTYPE, INTERPRET).to(tl.float32)
    return cast_rne(silu * up, DTYPE, INTERPRET)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_gm,
    stride_om,
    I,
    INTERPRET: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    # Grid: (rows, column blocks). Row offsets in int64: M * 2I can pass 2^31 at long prefills.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I]
    mask = cols < I

    gate_row = gate_up_ptr + row * stride_gm
    # Elementwise and memory bound: fp32 arithmetic costs nothing extra and also keeps
    # bf16 tiles out of the interpreter's broken bf16 arithmetic.
    gate = tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_row + I + cols, mask=mask, other=0.0).to(tl.float32)
    out = silu_mul_math(gate, up, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + row * stride_om + cols, out, mask=mask)


def _check_gate_up(gate_up: torch.Tensor) -> None:
    if gate_up.dim() != 2:
        raise ValueError(f"silu_mul: gate_up must be 2-D [M, 2I], got shape {tuple(gate_up.shape)}")
    if gate_up.shape[1] % 2 != 0:
        raise ValueError(
            f"silu_mul: gate_up's last dimension must be even (gate then up), got {gate_up.shape[1]}"
        )


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton SiLU·mul: ``gate_up`` [M, 2I] -> [M, I] in ``gate_up.dtype``."""
    _check_gate_up(gate_up)
    if gate_up.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"silu_mul: unsupported dtype {gate_up.dtype}")
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    m, two_i = gate_up.shape
    i = two_i // 2
    out = torch.empty((m, i), dtype=gate_up.dtype, device=gate_up.device)  # [M, I]
    if m == 0 or i == 0:
        return out
    block_i = min(triton.next_power_of_2(i), 1024)
    grid = (m, triton.cdiv(i, block_i))
    _silu_mul_kernel[grid](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        i,
        INTERPRET=dispatch.interpreter_active(),
        BLOCK_I=block_i,
        num_warps=4,
    )
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain torch (the CPU production path): ``F.silu(gate) * up`` in the input dtype."""
    _check_gate_up(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    # In-place multiply into silu's fresh output: same rounding, one allocation fewer.
    return F.silu(gate).mul_(up)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]``: Triton on CUDA, torch otherwise."""
    if dispatch.use_triton(gate_up):
        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)
