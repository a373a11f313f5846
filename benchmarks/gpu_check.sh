#!/bin/bash
# One call on a lent GPU machine (device tool), under 10 minutes: the GPU tests, the kernel
# benchmark, and a 1B-class throughput point on one GPU. Results land in $OUT (or bench_out/gpu).
#   bash benchmarks/gpu_check.sh
set -uo pipefail
OUT=${OUT:-bench_out/gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python -m pip install -q torch==2.13.0 2>/dev/null || true
python -m pip install -q -e ".[dev]" >"$OUT/install.log" 2>&1 || { echo "install failed"; tail -20 "$OUT/install.log"; }
timeout 240 python -m pytest -q tests/test_kernels_gpu.py tests/test_kernels_triton.py \
    tests/test_kernel_registry.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
timeout 150 python benchmarks/kernels.py --out "$OUT/kernels" 2>&1 | tail -20
timeout 150 python benchmarks/throughput.py --presets llama_1b --ds_configs zero1 --ranks 1 \
    --micro_batch_sizes 4 --seq_lengths 2048 --steps 12 --attention sdpa triton_flash \
    --out "$OUT/throughput" 2>&1 | tail -8
