"""C kernels for the CPU, built on first use with the machine's C compiler and loaded with
ctypes: what torch has no fused op for and runs slowly as many small ops (the FP8 KV codec,
paged decode and bf16 prefill attention, RoPE with the KV store, RMSNorm, SiLU-and-mul,
GEMMs on GGUF-quantised weights, bf16 GEMMs on AMX tiles, a bf16 decode layer in one call).

An engine builds it while it loads (``load_shard``); other callers on first use. It is
compiled once per machine (``-march=native``: it runs where it was built)
into the pdcluster cache, under a file lock so that replicas starting together build it
once, and keyed by its source and the CPU. Without a C compiler, or if the build fails,
``library()`` returns None and callers keep the torch reference (logged once); set
``PDCLUSTER_NO_NATIVE=1`` (or ``PDCLUSTER_MAX_CPU_ISA=none``) to choose that.
``PDCLUSTER_MAX_CPU_ISA=avx512`` or ``avx2`` builds it as a CPU without AMX (or without
AVX-512 either) would (``engine.cpu_isa``): each kernel keeps the paths that level allows.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch

from engine import cpu_isa
from engine.errors import EngineError

logger = logging.getLogger(__name__)

# The dtype codes the kernels take (cpu_native.h).
C_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}

_HERE = Path(__file__).parent
SOURCES = tuple(
    _HERE / name
    for name in (
        "kv_codec_cpu.c",
        "attention_cpu.c",
        "prefill_attention_cpu.c",
        "prefill_attention_amx.c",
        "fused_cpu.c",
        "quantized_cpu.c",
        "gemm_amx.c",
        "decode_layer_cpu.c",
    )
)
HEADERS = (_HERE / "cpu_native.h",)
# Bit-exact IEEE arithmetic as torch does it: no -ffast-math, no fused multiply-adds.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11")
# Parallel loops on torch's OpenMP threads: the library needs libgomp.so.1, which the loader
# resolves to the one torch has already loaded, so torch.set_num_threads governs both. A
# compiler without OpenMP builds the same kernels single-threaded.
OPENMP = "-fopenmp"


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built here (or are not wanted)."""
    try:
        level = cpu_isa.max_level()
    except ValueError as err:
        raise EngineError(str(err)) from None
    if level == "none":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler: the CPU kernels run in torch (slower)")
        return None
    try:
        return _build_and_load(compiler)
    except OSError as err:  # an unwritable cache, a broken library file
        logger.warning(
            "the CPU kernels could not be built or loaded, so they run in torch: %s", err
        )
        return None


@cache
def source_digest() -> str:
    """A hash of the kernels' C source: part of the keys of what was built or measured
    with them (the library here, the GEMM plans in engine.cpu_gemm)."""
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    return hashlib.sha256(source).hexdigest()[:16]


def _build_and_load(compiler: str) -> ctypes.CDLL | None:
    # Here, not at the top: cpu_gemm runs its SiLU through these kernels.
    from engine.cpu_gemm import cpu_signature, plan_cache_dir

    flags = (*FLAGS, *cpu_isa.compiler_flags())
    key = hashlib.sha256(
        source_digest().encode() + cpu_signature().encode() + " ".join((*flags, OPENMP)).encode()
    )
    directory = plan_cache_dir().parent / "native"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    with open(directory / f"{path.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            for extra in ((OPENMP,), ()):
                command = [compiler, *flags, *extra, *map(str, SOURCES), "-o", str(partial)]
                built = subprocess.run([*command, "-lm"], capture_output=True, text=True)
                if built.returncode == 0:
                    break
            else:
                logger.warning(
                    "building the CPU kernels failed; they run in torch: %s",
                    built.stderr.strip()[-500:],
                )
                return None
            os.replace(partial, path)
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.quantize_kv_blocks.argtypes = [ptr, ctypes.c_int, i64, i64, i64, i64, ptr, ptr]
    lib.quantize_kv_blocks.restype = None
    lib.dequantize_kv_blocks.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ctypes.c_int]
    lib.dequantize_kv_blocks.restype = None
    i32 = ctypes.c_int
    lib.paged_decode_attention.argtypes = [
        ptr, i32, i64, ptr, ptr, i32, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64,
        ctypes.c_float, ptr, i32,
    ]  # fmt: skip
    lib.paged_decode_attention.restype = i32
    lib.prefill_attention_bf16.argtypes = [
        ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
        ctypes.c_float, ptr, i64, i32,
    ]  # fmt: skip
    lib.prefill_attention_bf16.restype = i32
    lib.prefill_attention_bf16_available.argtypes = []
    lib.prefill_attention_bf16_available.restype = i32
    lib.prefill_attention_amx_bf16.argtypes = [
        ptr, i64, ptr, i64, ptr, i64, ptr, ptr,  # q, k, v with row strides; the caches
        ptr, ptr, i64,  # block tables, where each sequence's starts; block size
        i64, ptr, ptr, ptr,  # sequences; their first rows, lengths, prefixes
        i64, i64, i64, ctypes.c_float, ptr, i64, i32,
        ptr, ptr, i32,  # fp8 caches' scales, fp8 or not
    ]  # fmt: skip
    lib.prefill_attention_amx_bf16.restype = i32
    lib.prefill_attention_amx_available.argtypes = []
    lib.prefill_attention_amx_available.restype = i32
    lib.rope_and_store.argtypes = [
        ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i32, ptr, ptr, ptr, ptr, ptr, i32,
    ]  # fmt: skip
    lib.rope_and_store.restype = None
    lib.rmsnorm_rows.argtypes = [
        ptr, i64, ptr, i64, ptr, i64, i64, ctypes.c_float, i32, ptr, ptr, i32,
    ]  # fmt: skip
    lib.rmsnorm_rows.restype = None
    lib.silu_mul_rows.argtypes = [ptr, i64, i64, i64, i32, ptr, i32]
    lib.silu_mul_rows.restype = None
    lib.quantized_linear.argtypes = [ptr, i32, i64, i64, ptr, i64, i64, ptr, ptr, i64, i32]
    lib.quantized_linear.restype = i32
    lib.quantized_dequantize.argtypes = [ptr, i32, i64, i64, ptr, i32]
    lib.quantized_dequantize.restype = i32
    lib.amx_gemm_available.argtypes = []
    lib.amx_gemm_available.restype = i32
    lib.amx_shares_rows.argtypes = [i64, i32]
    lib.amx_shares_rows.restype = i32
    lib.amx_pack_weight.argtypes = [ptr, i64, i64, ptr, i32]
    lib.amx_pack_weight.restype = None
    lib.amx_linear_bf16.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i32]
    lib.amx_linear_bf16.restype = i32
    lib.amx_linear_silu_mul_bf16.argtypes = lib.amx_linear_bf16.argtypes
    lib.amx_linear_silu_mul_bf16.restype = i32
    lib.decode_layer_bf16.argtypes = [ptr, ptr, i32]
    lib.decode_layer_bf16.restype = i32
    return lib
