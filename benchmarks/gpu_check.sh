#!/bin/bash
# The GPU verdict: one prepared command on a bare machine with an NVIDIA GPU, .whl/ carried
# (bash benchmarks/gpu_wheels.sh makes it where the package registry is reachable):
#   bash benchmarks/gpu_check.sh           every part (budgets sum to 480 s, cold costs counted)
#   bash benchmarks/gpu_check.sh --quick   prepare, tests and launch only
#   bash benchmarks/gpu_check.sh --plan    the parts, their budgets and the tests each runs
# Results under $OUT (else bench_out/gpu), at most 8 files: verdict.txt and one log per part.
# Each part runs under its own budget (timeout) and prints its verdict line the moment it ends,
# so a run stopped early still says what it reached. Parts:
#   prepare   install .whl/ and this checkout, nvidia-smi; build the fused CUDA extension (the
#             cold cost the tests and the launch would otherwise pay inside their budgets)
#   tests     the GPU tests: nothing may skip (the CPU-only tests are deselected by name)
#   launch    1 GPU, bundled zero3, through the launcher and NCCL: 5 steps with evaluation and
#             a save, resume to step 7, export, and the export's held-out loss by transformers
#             (`dr-scale eval`) equal to the run's within 1%
#   kernels   the kernel table with each implementation's error against the fp32 reference
#             (correctness decides; the speed targets are reported per row, met or missed)
#   llama_1b  one throughput point of the full llama_1b preset, MFU against the datasheet peak
# On a machine without a visible CUDA GPU it stops at once with one line, writing nothing.
set -uo pipefail
cd "$(dirname "$0")/.."

PARTS=(prepare launch llama_1b kernels tests)
QUICK_PARTS=(prepare launch tests)
# Budgets from the first run on an H200 (2026-12-04): prepare 41-55 s (the CUDA extension
# 32-42 s of it); the launch's first 5 steps 58 s cold (kernel measurement included), its resume
# over 20 s; one Triton attention test 40 s cold (compiling, on the CPU: the tests run 8 at once);
# the kernel table's seq-1024 row under 60 s. A machine starts in 30-100 s and a command gets
# 600 s, so the parts sum to 480 s.
declare -A BUDGET=([prepare]=60 [launch]=150 [llama_1b]=100 [kernels]=60 [tests]=110)
GPU_TESTS=(tests/test_kernels_gpu.py tests/test_kernels_triton.py tests/test_kernel_registry.py
           tests/test_comm.py
           # every attention's document path on the GPU (sdpa: flex attention), with gradients
           "tests/test_document_mask.py::test_attention_within_documents_matches_fp64_sdpa")
# Tests that exist for CPU-only machines (they check the refusals a machine without CUDA gives)
CPU_ONLY=(
    "tests/test_kernel_registry.py::test_what_cannot_run_here_is_one_line"
    "tests/test_kernel_registry.py::test_why_gpu_implementations_cannot_run_is_collected_for_the_start_line"
)

parts=("${PARTS[@]}")
case "${1:-}" in
    --plan)
        total=0
        for part in "${PARTS[@]}"; do
            echo "part $part: budget ${BUDGET[$part]} s"
            total=$((total + BUDGET[$part]))
        done
        quick=0
        for part in "${QUICK_PARTS[@]}"; do quick=$((quick + BUDGET[$part])); done
        echo "total: $total s (--quick: prepare, tests and launch, $quick s)"
        for t in "${GPU_TESTS[@]}"; do echo "tests runs: $t"; done
        for t in "${CPU_ONLY[@]}"; do echo "tests deselects (CPU-only): $t"; done
        exit 0 ;;
    --quick) parts=("${QUICK_PARTS[@]}") ;;
    --part) PART=$2 ;;  # one part, run by this script under its budget (run_part)
    "") ;;
    *) echo "gpu_check: unknown argument ${1}; expected --plan or --quick" >&2; exit 2 ;;
esac

PY=${PY:-${PYTHON:-python3}}
if [ -n "${PART:-}" ]; then :; elif ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU visible to $PY (torch $($PY -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null || echo 'not importable')): this check needs a GPU machine" >&2
    exit 2
fi
OUT=${OUT:-bench_out/gpu}
WORK=${WORK:-/tmp/gpu_check}  # run folders, caches, tables: outside $OUT (8 files come back)

run_part() {  # part: this script again with --part, under the part's budget; its log in $OUT
    local part=$1 t0 rc line
    t0=$(date +%s)
    timeout --kill-after=5 "${BUDGET[$part]}" bash "$0" --part "$part" >"$OUT/$part.txt" 2>&1
    rc=$?
    line="gpu_check $part: "
    case $rc in
        0) line+="PASS ($(( $(date +%s) - t0 )) s of ${BUDGET[$part]})" ;;
        124|137) line+="FAIL (over its ${BUDGET[$part]} s budget)"; status=1 ;;
        *) line+="FAIL (rc $rc after $(( $(date +%s) - t0 )) s)"; status=1 ;;
    esac
    echo "$line; $(grep -v '^\s*$' "$OUT/$part.txt" | tail -1 | cut -c1-160)" \
        | tee -a "$OUT/verdict.txt"
    return $rc
}

part_prepare() {
    set -e
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    # One pip call for the wheelhouse (dr_scale's own wheel aside) and this checkout: with
    # --target, a second call replaces the first one's bin/ (deepspeed's launcher went missing)
    $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
        --no-cache-dir --target "$WORK/site" $(ls .whl/*.whl 2>/dev/null | grep -v '/dr_scale-') .
    # Commands run from the checkout, whose dr_scale/ comes first on sys.path and shadows the
    # installed copy; the links give it the two folders setup.py maps into the package, as a
    # developer's editable install does.
    for d in kernels ds_configs; do [ -e "dr_scale/$d" ] || ln -s "../$d" "dr_scale/$d"; done
    missing=$($PY -c "
import importlib.util
names = ['deepspeed', 'hjson', 'pydantic', 'sentencepiece', 'safetensors', 'transformers',
         'yaml', 'triton', 'dr_scale']
print(' '.join(n for n in names if importlib.util.find_spec(n) is None))")
    [ -z "$missing" ] || { echo "missing on this machine: $missing (carry them in .whl/)"; exit 1; }
    $PY -c "
import time
t = time.perf_counter()
from dr_scale.kernels import cuda
cuda.extension()
print(f'the fused CUDA extension built in {time.perf_counter() - t:.0f} s')"
    echo "prepared: $($PY -c 'import deepspeed, torch; print("deepspeed", deepspeed.__version__, "torch", torch.__version__)' 2>/dev/null)"
}

part_tests() {
    deselect=()
    for t in "${CPU_ONLY[@]}"; do deselect+=(--deselect "$t"); done
    # -v with each line's clock: a run stopped at its budget still shows what each test took
    # 8 at once: a cold Triton test spends its time compiling on the CPU (16 cores there)
    $PY -m pytest -v -rs -n 8 -p no:cacheprovider "${GPU_TESTS[@]}" "${deselect[@]}" 2>&1 \
        | while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done | tee "$WORK/tests.log"
    rc=${PIPESTATUS[0]}
    if grep -Eq '[0-9]+ skipped' "$WORK/tests.log"; then
        echo "tests: a test skipped on a GPU machine (listed above): on a GPU nothing may skip"
        exit 1
    fi
    exit "$rc"
}

part_launch() {
    set -e
    RUN="$WORK/launch_run"
    SHORT=(data.seq_length=256 train.warmup_steps=2 train.log_interval=1 train.eval_interval=5
           train.save_interval=5 train.eval_samples=16 logging.plot=false
           logging.tensorboard=false)
    deepspeed --num_gpus 1 launchers/pretrain.py --ds_config zero3 --run_dir "$RUN" \
        "${SHORT[@]}" train.max_steps=7 --stop_at_step 5
    deepspeed --num_gpus 1 launchers/pretrain.py --ds_config zero3 --run_dir "$RUN" --resume \
        --stop_at_step 7
    grep -q '"step": 7' "$RUN/metrics.jsonl"
    $PY -m dr_scale.cli export --run_dir "$RUN" --out "$WORK/launch_hf"
    # transformers' held-out loss on the export = the run's last evaluation, within 1%
    $PY -m dr_scale.cli eval --hf "$WORK/launch_hf" --run_dir "$RUN" --max_rel_diff 0.01
}

part_kernels() {
    $PY benchmarks/kernel_speed.py --seqs 4096 --out "$WORK/kernels"
}

part_llama_1b() {
    set -e
    $PY benchmarks/throughput.py --presets llama_1b --ds_configs zero1 --ranks 1 \
        --micro_batch_sizes 4 --seq_lengths 2048 --steps 8 --attention sdpa --no_peer \
        --out "$WORK/throughput"
}

export PY WORK OUT PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" PATH="$WORK/site/bin:$PATH"
if [ -n "${PART:-}" ]; then
    "part_$PART"
    exit $?
fi
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 DR_SCALE_CACHE="$WORK/cache" TORCH_EXTENSIONS_DIR="$WORK/extensions"
export TRITON_CACHE_DIR="$WORK/triton"
: >"$OUT/verdict.txt"
status=0
t_all=$(date +%s)
for part in "${parts[@]}"; do
    if ! run_part "$part" && [ "$part" = prepare ]; then
        echo "gpu_check: stopped: nothing else can run without what prepare installs" \
            | tee -a "$OUT/verdict.txt"
        exit 1
    fi
done
echo "gpu_check: $([ $status -eq 0 ] && echo PASS || echo FAIL) in $(( $(date +%s) - t_all )) s" \
    | tee -a "$OUT/verdict.txt"
exit $status
