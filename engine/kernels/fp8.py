"""FP8 e4m3 helpers shared by every kernel that writes or reads FP8 KV pages.

Scale convention (used by the KV cache, the kernels and the KV transfer codec alike):
one float32 scale per (block, kv head), ``scale = max(amax, FP8_MIN_AMAX) / FP8_MAX``, and
``dequantised = fp8_value.float() * scale``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# A block of all zeros still gets a finite, positive scale.
FP8_MIN_AMAX = 1e-12


@triton.jit
def _rint(x):
    """Round half to even, for fp32 values well inside the exactly representable range."""
    floor = tl.floor(x)
    diff = x - floor
    floor_is_odd = (floor - 2.0 * tl.floor(floor * 0.5)) != 0.0
    round_up = (diff > 0.5) | ((diff == 0.5) & floor_is_odd)
    return tl.where(round_up, floor + 1.0, floor)


def quantize_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch reference: ``x / scale`` saturated to ±448 and cast to e4m3 (torch rounds RNE)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Per-(block, head) scale from the absolute maximum of that block's values."""
    return amax.float().clamp_min(FP8_MIN_AMAX) / FP8_MAX


@triton.jit
def round_to_e4m3_grid(x):
    """Round fp32 ``x`` onto the e4m3 grid with round-to-nearest-even, saturating at ±448.

    The cast that follows (``.to(tl.float8e4nv)``) is then exact. This sidesteps the
    interpreter's dropped rounding carry and the GPUs' double rounding through fp16
    (see shared/TRITON_NOTES.md).
    """
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.uint32, bitcast=True)
    lowest_kept = (bits >> 20) & 1
    rounded_bits = (bits + 0x7FFFF + lowest_kept) & 0xFFF00000
    normal = rounded_bits.to(tl.float32, bitcast=True)
    # e4m3 subnormals (|x| < 2^-6) are multiples of 2^-9, rounded half to even on |x| so
    # that small negatives (and -0.0 itself: sign bit, not x < 0) keep their sign, as
    # torch's cast does.
    magnitude = _rint(tl.abs(x) * 512.0) / 512.0
    subnormal = tl.where((bits >> 31) != 0, -magnitude, magnitude)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def round_to_bf16_grid(x):
    """Round fp32 ``x`` onto the bf16 grid with round-to-nearest-even (result still fp32).

    Triton's interpreter casts fp32 -> bf16 by truncation (round toward zero), so kernels that
    store bf16 apply this first when running under the interpreter; the cast is then exact.
    Compiled kernels do not need it (the GPU's cvt.rn rounds to nearest even).
    """
    bits = x.to(tl.uint32, bitcast=True)
    lowest_kept = (bits >> 16) & 1
    rounded_bits = (bits + 0x7FFF + lowest_kept) & 0xFFFF0000
    return rounded_bits.to(tl.float32, bitcast=True)
