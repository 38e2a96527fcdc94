import json

import pytest
import torch

from engine import cpu_dtype
from engine.config import EngineConfig
from engine.errors import EngineError


@pytest.fixture
def timings(tmp_path, monkeypatch):
    """A fresh dtype cache, and a bf16 speed-up of the test's choosing (counted)."""
    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_dtype.PIN_VARIABLE, raising=False)  # the suite pins fp32
    measured = []

    def speedup_of(value):
        def fake():
            measured.append(value)
            return value

        monkeypatch.setattr(cpu_dtype, "bf16_speedup", fake)

    return speedup_of, measured, tmp_path


def test_bf16_only_where_its_matmuls_are_clearly_faster(timings, tmp_path, monkeypatch):
    speedup_of, measured, _ = timings
    speedup_of(3.0)  # AVX-512 BF16 / AMX
    assert cpu_dtype.cpu_auto_dtype() == torch.bfloat16
    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path / "avx2"))
    speedup_of(0.17)  # AVX2: bf16 emulated
    assert cpu_dtype.cpu_auto_dtype() == torch.float32
    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path / "close"))
    speedup_of(cpu_dtype.BF16_MIN_SPEEDUP - 0.01)
    assert cpu_dtype.cpu_auto_dtype() == torch.float32


def test_measured_once_per_machine_then_read_by_every_engine(timings):
    speedup_of, measured, cache = timings
    speedup_of(2.5)
    first = cpu_dtype.cpu_auto_dtype()
    speedup_of(0.5)  # a noisy second timing must not flip a later replica's choice
    assert cpu_dtype.cpu_auto_dtype() == first == torch.bfloat16
    assert measured == [2.5]
    (stored,) = cache.glob("gemm-plans/dtype-*.json")
    assert json.loads(stored.read_text()) == {"dtype": "bfloat16", "bf16_speedup": 2.5}


def test_a_cpu_with_other_instruction_sets_measures_its_own(timings, monkeypatch):
    # Same model name, other flags (an AVX2 host after an AVX-512 BF16 one, one home dir).
    speedup_of, measured, _ = timings
    monkeypatch.setattr(cpu_dtype, "cpu_signature", lambda: "AMD EPYC|AVX512|flags a")
    speedup_of(3.0)
    assert cpu_dtype.cpu_auto_dtype() == torch.bfloat16
    monkeypatch.setattr(cpu_dtype, "cpu_signature", lambda: "AMD EPYC|AVX2|flags b")
    speedup_of(0.17)
    assert cpu_dtype.cpu_auto_dtype() == torch.float32 and measured == [3.0, 0.17]


def test_the_cpu_signature_names_the_instruction_sets():
    from engine.cpu_gemm import cpu_signature

    assert torch.backends.cpu.get_cpu_capability() in cpu_signature()
    assert "flags " in cpu_signature()


def test_an_unreadable_choice_is_measured_again(timings):
    speedup_of, measured, cache = timings
    speedup_of(0.2)
    cpu_dtype.cpu_auto_dtype()
    (stored,) = cache.glob("gemm-plans/dtype-*.json")
    stored.write_text("{not json")
    assert cpu_dtype.cpu_auto_dtype() == torch.float32 and measured == [0.2, 0.2]


def test_auto_resolves_through_the_measurement_and_a_named_dtype_wins(timings):
    speedup_of, _, _ = timings
    speedup_of(3.0)
    cpu = torch.device("cpu")
    assert EngineConfig().resolve_dtype(cpu) == torch.bfloat16
    assert EngineConfig(dtype="float32").resolve_dtype(cpu) == torch.float32
    assert EngineConfig().resolve_dtype(torch.device("cuda")) == torch.bfloat16


def test_a_pinned_dtype_wins_and_a_bad_one_is_refused(timings, monkeypatch):
    speedup_of, measured, _ = timings
    speedup_of(3.0)
    monkeypatch.setenv(cpu_dtype.PIN_VARIABLE, "float32")
    assert cpu_dtype.cpu_auto_dtype() == torch.float32 and measured == []
    monkeypatch.setenv(cpu_dtype.PIN_VARIABLE, "fp64")
    with pytest.raises(EngineError, match="PDCLUSTER_CPU_DTYPE must be one of"):
        cpu_dtype.cpu_auto_dtype()


def test_the_real_measurement_is_a_positive_ratio():
    assert cpu_dtype.bf16_speedup() > 0
