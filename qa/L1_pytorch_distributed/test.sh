#!/usr/bin/env bash
# Multi-process FP8 with amax reduction: tests/pytorch/distributed/run_multi_device_fp8.py under
# torchrun with what this machine has, each run followed by the FINAL_HASH check
# (tests/pytorch/distributed/check_hashes.py):
#   >= 4 GPUs: 2 processes x 2 GPUs over NCCL (CUDA_VISIBLE_DEVICES = the first four GPUs);
#   >= 2 GPUs: 2 processes x 1 GPU and 1 process x 2 GPUs over NCCL;
#   always:    2 processes on the CPU over gloo (1 and 2 'cpu' devices per process).
# GPU runs that the machine cannot do are reported as skipped. Every run is attempted; the
# script prints a summary and exits 1 if any run failed.
#
# Uses the installed package (building it from this checkout, as qa/L0_pytorch_gpu does, when
# `import transformer_engine` fails). Logs go to $LOG_DIR/L1_pytorch_distributed (LOG_DIR
# defaults to $OUT when set, else ./qa_logs). PYTHON picks the interpreter (default python3);
# torchrun is `$PYTHON -m torch.distributed.run` unless TORCHRUN names a command.
set -uo pipefail

# Required on the GPU machines: keep NCCL's NVLink multicast (NVLS) and symmetric memory off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

TE_PATH=${TE_PATH:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
PYTHON=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-${OUT:-$TE_PATH/qa_logs}}
RUN_DIR="$LOG_DIR/L1_pytorch_distributed"
HARNESS=tests/pytorch/distributed/run_multi_device_fp8.py
CHECKER=tests/pytorch/distributed/check_hashes.py
ITERS=${ITERS:-10}
if [ -n "${TORCHRUN:-}" ]; then
  read -ra TORCHRUN_CMD <<<"$TORCHRUN"
else
  TORCHRUN_CMD=("$PYTHON" -m torch.distributed.run)
fi
cd "$TE_PATH" || exit 1
mkdir -p "$RUN_DIR"

passed=()
failed=()
skipped=()
step() { echo; echo "##### $*"; }

# -P: leave the checkout off sys.path, so the installed package is what gets imported.
if ! "$PYTHON" -P -c "import transformer_engine" 2>/dev/null; then
  step "transformer_engine is not installed: pip install --no-build-isolation --no-deps ."
  if ! MAX_JOBS=${MAX_JOBS:-16} "$PYTHON" -m pip install --no-build-isolation --no-deps -q . \
      >"$RUN_DIR/build.log" 2>&1; then
    tail -50 "$RUN_DIR/build.log"
    echo "BUILD FAILED"
    exit 1
  fi
fi
"$PYTHON" -P -c "import transformer_engine as t; print(t.__file__, t.native_status())"

# GPUs this job may use: the caller's CUDA_VISIBLE_DEVICES list if set, else every GPU.
NUM_GPUS=$("$PYTHON" -P -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
  IFS=',' read -ra GPU_IDS <<<"$CUDA_VISIBLE_DEVICES"
else
  GPU_IDS=()
  for ((i = 0; i < NUM_GPUS; i++)); do GPU_IDS+=("$i"); done
fi
gpu_list() { local IFS=,; echo "${GPU_IDS[*]:0:$1}"; }
echo "GPUs available to this job: $NUM_GPUS (${GPU_IDS[*]:-none})"

# run_case NAME NPROC DEVICES_PER_PROCESS DEVICE_TYPE BACKEND VISIBLE_GPUS
run_case() {
  local name=$1 nproc=$2 m=$3 device_type=$4 backend=$5 visible=$6
  local log="$RUN_DIR/$name.log"
  local cmd=("${TORCHRUN_CMD[@]}" --standalone --nproc_per_node="$nproc" --tee 3
    --log-dir "$RUN_DIR/$name.torchrun" "$HARNESS" --backend "$backend"
    --device-type "$device_type" --devices-per-process "$m" --iters "$ITERS")
  step "$name: CUDA_VISIBLE_DEVICES=$visible torchrun --standalone --nproc_per_node=$nproc" \
    "$HARNESS --backend $backend --device-type $device_type --devices-per-process $m"
  rm -rf "$RUN_DIR/$name.torchrun"
  local rc=0
  CUDA_VISIBLE_DEVICES="$visible" "${cmd[@]}" >"$log" 2>&1 || rc=$?
  grep -E "AMAX_ALL_REDUCE_COUNTS|FINAL_HASH|CHECK FAILED|HARNESS rank" "$log"
  if [ $rc -ne 0 ]; then
    tail -40 "$log"
    echo "$name: torchrun exited with $rc"
    failed+=("$name (torchrun exit $rc)")
  elif ! "$PYTHON" -P "$CHECKER" --world-size "$nproc" "$log"; then
    failed+=("$name (hash check)")
  else
    passed+=("$name")
  fi
}

skip_case() {
  echo
  echo "##### $1: SKIPPED ($2)"
  skipped+=("$1 ($2)")
}

if [ "$NUM_GPUS" -ge 4 ]; then
  run_case nccl_2proc_x_2gpu 2 2 cuda nccl "$(gpu_list 4)"
else
  skip_case nccl_2proc_x_2gpu "needs 4 GPUs, $NUM_GPUS visible"
fi
if [ "$NUM_GPUS" -ge 2 ]; then
  run_case nccl_2proc_x_1gpu 2 1 cuda nccl "$(gpu_list 2)"
  run_case nccl_1proc_x_2gpu 1 2 cuda nccl "$(gpu_list 2)"
else
  skip_case nccl_2proc_x_1gpu "needs 2 GPUs, $NUM_GPUS visible"
  skip_case nccl_1proc_x_2gpu "needs 2 GPUs, $NUM_GPUS visible"
fi
# CPU runs hide the GPUs, so they show the gloo path needs no CUDA at all.
run_case gloo_2proc_cpu 2 1 cpu gloo ""
run_case gloo_2proc_x_2cpu 2 2 cpu gloo ""

echo
echo "##### summary (logs in $RUN_DIR)"
for name in "${passed[@]}"; do echo "PASSED  $name"; done
for name in "${skipped[@]}"; do echo "SKIPPED $name"; done
for name in "${failed[@]}"; do echo "FAILED  $name"; done
if [ ${#failed[@]} -gt 0 ]; then
  echo "L1 pytorch distributed: ${#failed[@]} run(s) FAILED"
  exit 1
fi
echo "L1 pytorch distributed: ${#passed[@]} run(s) passed, ${#skipped[@]} skipped"
