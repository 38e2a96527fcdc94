"""The highest x86 instruction set the CPU paths may use: what this CPU has, or less when
``PDCLUSTER_MAX_CPU_ISA`` asks for less.

Machines differ (AVX2 only, AVX-512 BF16, AMX) and each takes other code paths: the C
kernels are built with ``-march=native`` and keep only the paths the CPU's instructions
allow, oneDNN and ATen pick their own kernels at run time, and the GEMM plan and the
``dtype: auto`` choice are measured on what is left. Forcing a lower level runs a smaller
CPU's paths on a bigger one, so a change made on an AMX machine is also checked on the
AVX-512 and AVX2 paths (``.ci/run`` does), and a cluster of mixed CPUs can run one level:

- ``native`` (or unset): whatever this CPU has.
- ``avx512``: AVX-512 BF16, no AMX: the C kernels built without AMX, oneDNN capped at
  AVX-512 BF16.
- ``avx2``: no AVX-512 and no AMX: the C kernels built without either, oneDNN capped at
  AVX2 and ATen's vector kernels at AVX2.
- ``none``: no C kernels at all, the torch references (as ``PDCLUSTER_NO_NATIVE=1``).

A level above what the CPU has is the CPU's own: nothing can add instructions. This module
imports nothing heavy: ``engine/__init__`` calls ``forward_to_libraries`` before torch runs
its first op, since oneDNN and ATen read their own caps once, at first use.
"""

from __future__ import annotations

import os

VARIABLE = "PDCLUSTER_MAX_CPU_ISA"
LEVELS = ("none", "avx2", "avx512", "native")  # lowest first

# What each level turns off in a -march=native build (GCC and Clang take these): -mno-amx-tile
# also drops the AMX extensions built on it, -mno-avx512f every AVX-512 extension.
_NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
COMPILER_FLAGS = {"avx512": _NO_AMX, "avx2": (*_NO_AMX, "-mno-avx512f")}
# The same caps in oneDNN's (ONEDNN_MAX_CPU_ISA) and ATen's (ATEN_CPU_CAPABILITY) names.
_LIBRARY_CAPS = {
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}


def max_level() -> str:
    """The level asked for: one of ``LEVELS`` (``native`` when nothing is set)."""
    if os.environ.get("PDCLUSTER_NO_NATIVE"):
        return "none"
    level = os.environ.get(VARIABLE, "").strip().lower() or "native"
    if level not in LEVELS:
        raise ValueError(f"{VARIABLE} must be one of {', '.join(LEVELS)} (or unset), got {level!r}")
    return level


def cpu_level() -> str:
    """This CPU's own level, by its flags: ``amx`` (AMX tiles with bf16), ``avx512``
    (AVX-512 with BF16, which every AVX-512 path of the kernels needs), ``avx2``, or
    ``none`` (anything less, or not x86)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.partition(":")[2].split())
                break
        else:
            return "none"
    except OSError:
        return "none"
    if {"amx_tile", "amx_bf16", "avx512f", "avx512_bf16"} <= flags:
        return "amx"
    if {"avx512f", "avx512_bf16"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "none"


def levels_below_cpu() -> list[str]:
    """The forced levels that run other paths than this CPU's own, highest first."""
    return list(reversed(_ORDER[: _ORDER.index(cpu_level())]))


_ORDER = ("none", "avx2", "avx512", "amx")
_NAMES = {"avx2": "AVX2", "avx512": "AVX-512 BF16", "amx": "AMX-BF16 tiles"}


def why_missing(needed: str) -> str:
    """Why paths that need ``needed`` (avx2, avx512, amx; none: the C kernels at all) do not
    run here: the forced level, the CPU, or the build (no C compiler). For skip reasons."""
    level = max_level()
    forced = _ORDER.index("amx" if level == "native" else level)
    if forced < max(_ORDER.index(needed), 1):
        if os.environ.get("PDCLUSTER_NO_NATIVE"):
            return "PDCLUSTER_NO_NATIVE=1 keeps them off"
        return f"{VARIABLE}={level} keeps them off"
    if _ORDER.index(cpu_level()) < _ORDER.index(needed):
        return f"this CPU has no {_NAMES[needed]}"
    return "the C kernels are not built here (no C compiler, or the build failed)"


def compiler_flags() -> tuple[str, ...]:
    """Flags after ``-march=native`` that keep the C kernels within the level."""
    return COMPILER_FLAGS.get(max_level(), ())


def forward_to_libraries() -> None:
    """Cap oneDNN and ATen at the level too (a cap the user set themselves is kept). A bad
    value is left for ``max_level``'s error where the kernels are built."""
    try:
        level = max_level()
    except ValueError:
        return
    for name, value in _LIBRARY_CAPS.get(level, {}).items():
        os.environ.setdefault(name, value)
