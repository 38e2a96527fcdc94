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

import fcntl
import hashlib
import json
import os
import platform
import time

import torch
import torch.nn.functional as F

from engine.cpu_gemm import cpu_signature, plan_cache_dir
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
    directory = plan_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(
        "|".join([platform.machine(), cpu_signature(), torch.__version__]).encode()
    ).hexdigest()[:16]
    path = directory / f"dtype-{key}.json"
    with open(directory / f"dtype-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # replicas starting together measure once
        try:
            return _DTYPES[json.loads(path.read_text())["dtype"]]
        except (OSError, ValueError, KeyError):
            pass  # not measured on this machine yet (or unreadable): measure now
        speedup = bf16_speedup()
        dtype = "bfloat16" if speedup >= BF16_MIN_SPEEDUP else "float32"
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps({"dtype": dtype, "bf16_speedup": round(speedup, 2)}))
        os.replace(partial, path)
        return _DTYPES[dtype]


def bf16_speedup() -> float:
    """fp32 GEMM time / bf16 GEMM time at one transformer-sized shape (best of 3 each)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_ROWS, _IN, generator=generator)
    w = torch.randn(_OUT, _IN, generator=generator)
    with torch.inference_mode():
        fp32 = _best_seconds(lambda: F.linear(x, w))
        xb, wb = x.bfloat16(), w.bfloat16()
        bf16 = _best_seconds(lambda: F.linear(xb, wb))
    return fp32 / bf16


def _best_seconds(fn) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
