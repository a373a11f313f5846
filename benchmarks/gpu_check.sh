#!/bin/bash
# The GPU verdict, one call on a machine with an NVIDIA GPU, within 8 minutes:
#   bash benchmarks/gpu_check.sh            (results under $OUT, else bench_out/gpu)
# Parts, each written to its own file as it finishes, then one PASS/FAIL line per part:
#   tests     the GPU tests (a skipped one fails the part: on a GPU nothing may skip)
#   launch    1 GPU, ZeRO-3, through the launcher and NCCL (kernels chosen by measurement, the
#             table shown): 5 steps with evaluation and a save,
#             a resume to step 7, an export that transformers loads
#   kernels   the kernel table (SDPA flash, cuDNN, ours; GQA 32:8; % of peak)
#   llama_1b  one throughput point of the full llama_1b preset on one GPU
# Packages the machine lacks (DeepSpeed, ...) travel as wheels in .whl/ (see README, "GPU check").
# On a machine without a visible CUDA GPU it stops at once with one line.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU visible to $PY (torch $($PY -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null || echo 'not importable')): this check needs a GPU machine" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >"$OUT/install.log" 2>&1 || { echo "gpu_check: wheels in .whl/ did not install (see $OUT/install.log)" >&2; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1 \
    || { echo "gpu_check: pip install -e . failed (see $OUT/install.log)" >&2; exit 2; }
missing=$($PY - <<'EOF'
import importlib.util
names = ["deepspeed", "sentencepiece", "safetensors", "transformers", "yaml", "triton"]
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$missing" ]; then
    echo "gpu_check: missing on this machine: $missing (carry them as wheels in .whl/)" >&2
    exit 2
fi
export PYTHONUNBUFFERED=1 DR_SCALE_CACHE="$OUT/cache"
declare -A VERDICT

# 1. GPU tests: any skip is a failure here.
timeout 200 $PY -m pytest -q -rs tests/test_kernels_gpu.py tests/test_kernels_triton.py \
    tests/test_kernel_registry.py tests/test_comm.py >"$OUT/tests.txt" 2>&1
rc=$?
skipped=$(grep -Eo '[0-9]+ skipped' "$OUT/tests.txt" | head -1)
if [ $rc -eq 0 ] && [ -z "$skipped" ]; then VERDICT[tests]=PASS; else VERDICT[tests]="FAIL (rc $rc${skipped:+, $skipped})"; fi
tail -3 "$OUT/tests.txt"

# 2. The launcher on one GPU through NCCL: train, evaluate, save, resume, export.
RUN="$OUT/launch_run"
rm -rf "$RUN"
SHORT=(data.seq_length=256 train.warmup_steps=2 train.log_interval=1 train.eval_interval=5
       train.save_interval=5 train.eval_samples=16 logging.plot=false logging.tensorboard=false)
{
    timeout 150 deepspeed --num_gpus 1 launchers/pretrain.py --ds_config zero3 --run_dir "$RUN" \
        "${SHORT[@]}" train.max_steps=7 --stop_at_step 5 &&
    timeout 100 deepspeed --num_gpus 1 launchers/pretrain.py --ds_config zero3 --run_dir "$RUN" \
        --resume --stop_at_step 7 &&
    timeout 60 $PY -m dr_scale.cli export --run_dir "$RUN" --out "$OUT/launch_hf" &&
    $PY - "$OUT/launch_hf" <<'EOF'
import sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
print("export loads:", type(m).__name__, sum(p.numel() for p in m.parameters()), "parameters")
EOF
} >"$OUT/launch.txt" 2>&1
rc=$?
grep -m1 -A14 "kernels measured" "$OUT/launch.txt"  # auto's choice by measurement
grep -E "^(train|eval) +step|start|export loads|Error" "$OUT/launch.txt" | tail -12
if [ $rc -eq 0 ] && grep -q "step      7/7" "$OUT/launch.txt"; then VERDICT[launch]=PASS; else VERDICT[launch]="FAIL (rc $rc)"; fi

# 3. The kernel table.
timeout 120 $PY benchmarks/kernels.py --out "$OUT/kernels" >"$OUT/kernels.txt" 2>&1
rc=$?
tail -20 "$OUT/kernels.txt"
if [ $rc -eq 0 ]; then VERDICT[kernels]=PASS; else VERDICT[kernels]="FAIL (rc $rc)"; fi

# 4. One llama_1b throughput point, start-up included.
timeout 150 $PY benchmarks/throughput.py --presets llama_1b --ds_configs zero1 --ranks 1 \
    --micro_batch_sizes 4 --seq_lengths 2048 --steps 8 --attention sdpa --no_peer \
    --out "$OUT/throughput" >"$OUT/llama_1b.txt" 2>&1
rc=$?
tail -6 "$OUT/llama_1b.txt"
if [ $rc -eq 0 ]; then VERDICT[llama_1b]=PASS; else VERDICT[llama_1b]="FAIL (rc $rc)"; fi

echo
status=0
for part in tests launch kernels llama_1b; do
    echo "gpu_check $part: ${VERDICT[$part]}" | tee -a "$OUT/verdict.txt"
    [ "${VERDICT[$part]}" = PASS ] || status=1
done
exit $status
