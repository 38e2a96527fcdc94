"""The model dtype ``dtype: auto`` means on CPU, chosen by measurement.

bf16 halves the bytes every decode step reads, but whether its matmuls are fast depends on
the CPU: with AVX-512 BF16 or AMX (native bf16 dot products) oneDNN runs them about 3x
faster than fp32; on AVX2 alone they are emulated and run ~6x slower. So the first engine on
a machine times one GEMM of a transformer's shape in both dtypes and picks bf16 only when it
is clearly faster (``BF16_MIN_SPEEDUP``).

The choice is kept on disk beside the GEMM plans (``engine.cpu_gemm.plan_cache_dir``), keyed
by the CPU and the torch build, and read by every later engine: every replica on a machine
then resolves ``auto`` alike (a prefill and a decode replica must agree on the KV cache
dtype), whatever its thread count, and start-up skips the timing.

``PDCLUSTER_CPU_DTYPE=float32`` (or ``bfloat16``) pins what ``auto`` means instead, e.g. for
a cluster of mixed CPUs, or a test suite that holds the engine to fp32 references.
"""

from __future__ import annotations

import hashlib
import os
import platform

import torch
import torch.nn.functional as F

from engine.cpu_gemm import best_ms, cached_measurement, cpu_signature, plan_cache_dir
from engine.errors import EngineError

BF16_MIN_SPEEDUP = 1.5
PIN_VARIABLE = "PDCLUSTER_CPU_DTYPE"
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_ROWS, _IN, _OUT = 256, 1024, 2048  # a prefill step's GEMM on a small model


def cpu_auto_dtype() -> torch.dtype:
    """bf16 where this CPU's bf16 matmuls beat fp32's by ``BF16_MIN_SPEEDUP``, else fp32."""
    pinned = os.environ.get(PIN_VARIABLE)
    if pinned:
        if pinned not in _DTYPES:
            raise EngineError(
                f"{PIN_VARIABLE} must be one of {sorted(_DTYPES)} (or unset), got {pinned!r}"
            )
        return _DTYPES[pinned]
    key = hashlib.sha256(
        "|".join([platform.machine(), cpu_signature(), torch.__version__]).encode()
    ).hexdigest()[:16]

    def measure() -> tuple[dict, torch.dtype]:
        speedup = bf16_speedup()
        dtype = "bfloat16" if speedup >= BF16_MIN_SPEEDUP else "float32"
        return {"dtype": dtype, "bf16_speedup": round(speedup, 2)}, _DTYPES[dtype]

    path = plan_cache_dir() / f"dtype-{key}.json"
    return cached_measurement(path, measure, lambda data: _DTYPES[data["dtype"]])


def bf16_speedup() -> float:
    """fp32 GEMM time / bf16 GEMM time at one transformer-sized shape (best of 3 each)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_ROWS, _IN, generator=generator)
    w = torch.randn(_OUT, _IN, generator=generator)
    with torch.inference_mode():
        fp32 = best_ms(lambda: F.linear(x, w))
        xb, wb = x.bfloat16(), w.bfloat16()
        bf16 = best_ms(lambda: F.linear(xb, wb))
    return fp32 / bf16
