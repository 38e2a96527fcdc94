"""benchmarks.step_ops on the tiny model: its clocks still sit on calls a step makes (a
renamed or bypassed call would leave its column at zero), and the parts add up to no more
than the step."""

from __future__ import annotations

import pytest

from benchmarks.step_ops import parse_args, run


def _table(lines: list[str]) -> tuple[list[str], list[list[float]]]:
    labels = lines[1].split()
    rows = [[float(v) for v in line.split()] for line in lines[2:]]
    return labels, rows


@pytest.mark.parametrize(
    "argv, clocked",
    [
        (
            ["--prefill", "48"],
            ["qkv", "rope+store", "attention", "o", "rmsnorm", "gate_up", "down"],
        ),
        (["--batch", "2", "--context", "20"], ["plan", "inputs", "layers", "lm_head", "sample"]),
    ],
)
def test_every_clock_sees_its_call(argv, clocked, monkeypatch):
    args = parse_args(["--model", "tiny", "--threads", "1", "--steps", "2", *argv])
    labels, rows = _table(run(args, patch=monkeypatch.setattr))
    assert labels[0] == "step" and labels[-1] == "rest" and len(rows) == 2
    for row in rows:
        parts = dict(zip(labels, row, strict=True))
        assert all(parts[label] > 0 for label in clocked), parts
        assert sum(row[1:-1]) <= row[0] + 1e-6  # clocked parts within the step


def test_a_decode_step_op_by_op_clocks_its_layers(monkeypatch):
    """Where the CPU has AMX a bf16 decode step may run its layers as one C call each, on
    other CPUs always op by op: "layers" sees that path too (forced here on any CPU), and the
    layers' own RMSNorms count as "layers", not as "final_norm"."""
    from engine.kernels import decode_layers_cpu

    monkeypatch.setattr(decode_layers_cpu.NativeDecodeLayers, "applies", lambda *a: False)
    args = parse_args(["--model", "tiny", "--threads", "1", "--steps", "2", "--batch", "2"])
    labels, rows = _table(run(args, patch=monkeypatch.setattr))
    for row in rows:
        parts = dict(zip(labels, row, strict=True))
        assert parts["layers"] > 0 and parts["final_norm"] > 0, parts
        assert parts["final_norm"] < parts["layers"] / 2, parts  # one norm, not 9
        assert sum(row[1:-1]) <= row[0] + 1e-6


def test_the_clocks_are_gone_after_the_test():
    import engine.model as model_module
    from engine.kernels import decode_layers_cpu, rmsnorm

    assert model_module.rmsnorm is rmsnorm.rmsnorm
    assert "timed" not in decode_layers_cpu.NativeDecodeLayers.__call__.__qualname__
    assert "timed" not in model_module.DecoderLayer.forward.__qualname__
