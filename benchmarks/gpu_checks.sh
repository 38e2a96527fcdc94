#!/usr/bin/env bash
# Every GPU check in one run, for a CUDA machine lent for a few minutes: the Triton kernels
# against their references and SDPA/cuBLAS, then every test marked `gpu` (the kernels, CUDA
# graphs, the Triton engine, tensor parallelism over NCCL where there are two GPUs).
#   bash benchmarks/gpu_checks.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/out/gpu}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
.venv/bin/pdcluster bench kernels 2>&1 | tee "$out/bench_kernels.txt"
TRITON_INTERPRET=0 .venv/bin/python -m pytest -q -m gpu -rs 2>&1 | tee "$out/pytest_gpu.txt"
