#!/usr/bin/env bash
# Issue 4's GPU checks in one call on a lent GPU machine (the device tool's `run`), with
# that machine's own python3, torch and triton: nothing is installed there.
#   1. the machine: nvidia-smi, torch / triton versions          -> $OUT/machine.txt
#   2. the Triton kernel tests and the engine's Triton == torch
#      token checks (eager, and decode steps as CUDA graphs)     -> $OUT/tests.txt
#   3. bench/kernels.py --sweep (decode GB/s, prefill TFLOP/s,
#      engine tok/s eager / graphs / torch, launch variants),
#      rewritten per section                                     -> $OUT/kernels.json
# The summary tables print last. Budgets (seconds): TESTS_S=150, BENCH_S=390.
#   device run: bash bench/gpu_run.sh   (timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
py=${PYTHON:-python3}

{
  nvidia-smi
  "$py" -c 'import sys, torch, triton; print(sys.version); print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
} > "$out/machine.txt" 2>&1
grep -E "Driver Version|torch|H[12]00|MiB" "$out/machine.txt" | head -6

tests=(
  tests/engine/kernels/test_kernels_decode_attention.py
  tests/engine/kernels/test_kernels_extend_attention.py
  tests/engine/kernels/test_kernels_int8_kv.py
  tests/engine/kernels/test_kernels_kv_write.py
  tests/engine/kernels/test_triton_attention_backend.py
  tests/engine/kernels/test_triton_engine_e2e.py
  tests/engine/test_engine_config.py
  tests/engine/test_engine_gpu_memory.py
)
# --confcutdir: the top conftest's database fixtures import SQLAlchemy, absent there.
timeout "${TESTS_S:-150}" "$py" -m pytest -q -p no:cacheprovider --confcutdir=tests/engine \
  "${tests[@]}" > "$out/tests.txt" 2>&1
echo "tests rc=$?"
tail -n 12 "$out/tests.txt"

timeout "${BENCH_S:-390}" "$py" bench/kernels.py --sweep --out "$out/kernels.json" \
  > /dev/null 2> "$out/kernels.log"
echo "bench rc=$?"
tail -n 4 "$out/kernels.log"
"$py" bench/kernel_summary.py "$out/kernels.json"
