"""C kernels for the CPU, built on first use with the machine's C compiler and loaded with
ctypes: what torch has no fused op for and does slowly element by element (the FP8 KV codec).

The library is compiled once per machine (``-march=native``: it runs where it was built)
into the pdcluster cache, under a file lock so that replicas starting together build it
once, and keyed by its source and the CPU. Without a C compiler, or if the build fails,
``library()`` returns None and callers keep the torch reference (logged once); set
``PDCLUSTER_NO_NATIVE=1`` to choose that.
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

from engine.cpu_gemm import cpu_signature, plan_cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kv_codec_cpu.c")
# Bit-exact IEEE arithmetic as torch does it: no -ffast-math, no fused multiply-adds.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11")


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot be built here."""
    if os.environ.get("PDCLUSTER_NO_NATIVE"):
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler: the CPU FP8 KV codec runs in torch (slower)")
        return None
    try:
        return _build_and_load(compiler)
    except OSError as err:  # an unwritable cache, a broken library file
        logger.warning(
            "the CPU FP8 KV codec could not be built or loaded, so it runs in torch: %s", err
        )
        return None


def _build_and_load(compiler: str) -> ctypes.CDLL | None:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + cpu_signature().encode() + " ".join(FLAGS).encode())
    directory = plan_cache_dir().parent / "native"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"kv_codec_cpu-{key.hexdigest()[:16]}.so"
    with open(directory / f"{path.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            built = subprocess.run(
                [compiler, *FLAGS, str(SOURCE), "-o", str(partial), "-lm"],
                capture_output=True,
                text=True,
            )
            if built.returncode != 0:
                logger.warning(
                    "building the CPU FP8 KV codec failed; it runs in torch: %s",
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
    return lib
