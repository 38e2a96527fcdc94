#!/usr/bin/env bash
# Every GPU check in one run, for a CUDA machine lent for a few minutes, each part time-boxed:
#   1. every test marked `gpu` (each Triton kernel against its torch reference, the engine's
#      Triton path against transformers, CUDA graphs, tensor parallelism over NCCL where
#      there are two GPUs);
#   2. `bench engine` on a SmolLM2-135M-shaped checkpoint (random weights: the real file does
#      not travel to such a machine) in bf16, next to transformers batched on the same GPU;
#   3. `bench kernels`: each kernel next to SDPA flash / cuBLAS / HBM bandwidth, and an
#      8k-token Llama-3-8B-shaped prefill with its MFU.
# Needs only torch, triton, transformers, tokenizers, safetensors, jinja2, msgpack and pytest
# (not Ray or the server), so it runs under a GPU image's own Python:
#   PYTHON=python3 bash benchmarks/gpu_checks.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/out/gpu}"
py="${PYTHON:-.venv/bin/python}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

part() {  # part SECONDS LOG COMMAND...: run COMMAND for at most SECONDS, output into LOG too
    local limit=$1 log=$2
    shift 2
    echo "== $* (at most ${limit}s)" | tee "$log"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    echo "== exit ${PIPESTATUS[0]} after $((SECONDS - start))s" | tee -a "$log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv |
    tee "$out/gpu.txt"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" |
    tee -a "$out/gpu.txt"

gpu_test_files=$(grep -rl "pytest.mark.gpu" tests --include='test_*.py' | sort)
part "${GPU_TESTS_S:-170}" "$out/pytest_gpu.txt" \
    "$py" -m pytest -q -m gpu -rs -p no:cacheprovider $gpu_test_files

shaped=$(mktemp -d)
"$py" -m benchmarks.shaped_checkpoint smollm2-135m "$shaped" >/dev/null
part "${ENGINE_S:-150}" "$out/bench_engine.txt" \
    "$py" -m benchmarks.engine_bench --model "$shaped" --dtype bfloat16 \
    --prefill 1x256,1x1676,1x4096,32x256 --json-out "$out/engine.json"

part "${KERNELS_S:-200}" "$out/bench_kernels.txt" \
    "$py" -m benchmarks.gpu_kernels --json-out "$out/kernels.json"
