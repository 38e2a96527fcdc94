"""PDCLUSTER_MAX_CPU_ISA: a forced level keeps the C kernels, oneDNN and ATen within it, so a
bigger CPU runs a smaller one's paths; a bad value is a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine import cpu_isa
from engine.errors import EngineError
from engine.kernels import cpu_native

PROBE = """
import json, os
from engine.kernels import cpu_native
lib = cpu_native.library()
import torch
print(json.dumps({
    "amx": lib.amx_gemm_available(),
    "amx_prefill": lib.prefill_attention_amx_available(),
    "avx512_bf16_prefill": lib.prefill_attention_bf16_available(),
    "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA"),
    "aten": torch.backends.cpu.get_cpu_capability(),
}))
"""


def _probe(level: str, tmp_path) -> dict:
    env = {**os.environ, cpu_isa.VARIABLE: level, "PDCLUSTER_CACHE": str(tmp_path)}
    for name in ("PDCLUSTER_NO_NATIVE", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(cpu_native.library() is None, reason=cpu_isa.why_missing("none"))
@pytest.mark.parametrize("level", ["avx512", "avx2"])
def test_a_forced_level_builds_the_kernels_without_what_is_above_it(level, tmp_path):
    seen = _probe(level, tmp_path)
    assert seen["amx"] == 0 and seen["amx_prefill"] == 0  # on any CPU, AMX or not
    if level == "avx2":
        assert seen["avx512_bf16_prefill"] == 0
        assert seen["onednn"] == "AVX2" and seen["aten"] == "AVX2"
    else:
        assert seen["onednn"] == "AVX512_CORE_BF16"


def test_levels_and_their_flags(monkeypatch):
    monkeypatch.delenv("PDCLUSTER_NO_NATIVE", raising=False)
    monkeypatch.delenv(cpu_isa.VARIABLE, raising=False)
    assert cpu_isa.max_level() == "native" and cpu_isa.compiler_flags() == ()
    monkeypatch.setenv(cpu_isa.VARIABLE, "AVX2")
    assert cpu_isa.max_level() == "avx2"
    assert {"-mno-avx512f", "-mno-amx-tile"} <= set(cpu_isa.compiler_flags())
    monkeypatch.setenv(cpu_isa.VARIABLE, "avx512")
    assert "-mno-avx512f" not in cpu_isa.compiler_flags()
    assert cpu_isa.why_missing("amx") == f"{cpu_isa.VARIABLE}=avx512 keeps them off"
    monkeypatch.setenv("PDCLUSTER_NO_NATIVE", "1")
    assert cpu_isa.max_level() == "none"
    below = cpu_isa.levels_below_cpu()
    assert below == sorted(below, key=cpu_isa.LEVELS.index, reverse=True)
    assert cpu_isa.cpu_level() not in below


def test_a_bad_level_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("PDCLUSTER_NO_NATIVE", raising=False)
    monkeypatch.setenv(cpu_isa.VARIABLE, "avx1024")
    cpu_isa.forward_to_libraries()  # at import: leaves the error to where kernels are built
    cpu_native.library.cache_clear()
    try:
        with pytest.raises(EngineError, match="PDCLUSTER_MAX_CPU_ISA must be one of"):
            cpu_native.library()
    finally:
        monkeypatch.delenv(cpu_isa.VARIABLE)
        cpu_native.library.cache_clear()


def test_a_cap_the_user_set_is_kept(monkeypatch):
    environ = {cpu_isa.VARIABLE: "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"}
    monkeypatch.setattr(os, "environ", environ)  # not this process's: Ray workers inherit it
    cpu_isa.forward_to_libraries()
    assert environ["ONEDNN_MAX_CPU_ISA"] == "AVX2_VNNI"
    assert environ["ATEN_CPU_CAPABILITY"] == "avx2"
