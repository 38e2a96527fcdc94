"""The GPU kernel benchmark's own code paths, at toy shapes in Triton's interpreter, so a
device session spends its minutes measuring, not debugging the script."""

from __future__ import annotations

from benchmarks.gpu_kernels import PARTS, KernelBench, format_table


def test_gpu_kernel_bench_smoke(monkeypatch):
    monkeypatch.setenv("PDCLUSTER_FORCE_TRITON", "1")
    rows = KernelBench(smoke=True).run(PARTS)
    print(format_table(rows))
    assert {r.kernel.split(" (")[0].split(" ")[0] for r in rows} >= {
        "prefill",
        "GEMM",
        "paged",
        "fp8",
        "Llama-3-8B",
    }
    assert not [r for r in rows if r.check.startswith("FAIL")]
