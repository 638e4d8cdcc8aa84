#!/usr/bin/env bash
# GPU job for a machine with CUDA GPUs and no network (the lent H200 machines):
#   1. build and install the package from this checkout (pip install --no-build-isolation .),
#   2. run the unit suites (CPU and GPU; the two-GPU tests run when two GPUs are visible),
#   3. run the native-kernel GPU tests once more under compute-sanitizer memcheck (0 errors),
#   4. with two GPUs, the amax reduction over NCCL (torchrun, 2 processes x 1 GPU),
#   5. run the quantize benchmark (and with two GPUs the tensor-parallel MLP benchmark, with the
#      unoverlapped baseline and the ub_* overlap flags).
# Logs go to $LOG_DIR (default: $OUT when set, else ./qa_logs).
set -uo pipefail

TE_PATH=${TE_PATH:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
PYTHON=${PYTHON:-python3}
LOG_DIR=${LOG_DIR:-${OUT:-$TE_PATH/qa_logs}}
mkdir -p "$LOG_DIR"
cd "$TE_PATH"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

status=0
step() { echo; echo "##### $*"; }

step "build: pip install --no-build-isolation --no-deps ."
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$LOG_DIR/gpus.txt"
if ! MAX_JOBS=${MAX_JOBS:-16} NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-89;90;100;120} \
    "$PYTHON" -m pip install --no-build-isolation --no-deps -q . >"$LOG_DIR/build.log" 2>&1; then
  tail -50 "$LOG_DIR/build.log"
  echo "BUILD FAILED"
  exit 1
fi
"$PYTHON" -P -m transformer_engine

step "unit suites"
XML_LOG_DIR="$LOG_DIR/xml" PYTHON="$PYTHON" bash qa/L0_pytorch_unittest/test.sh \
  2>&1 | tee "$LOG_DIR/unittest.log" || status=1

step "compute-sanitizer memcheck over the native-kernel tests"
SANITIZER=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -x "$SANITIZER" ]; then
  "$SANITIZER" --tool memcheck --error-exitcode 99 --print-limit 20 \
    "$PYTHON" -P -m pytest -q -x tests/pytorch/kernels/test_native_kernels_gpu.py \
    >"$LOG_DIR/memcheck.log" 2>&1
  rc=$?
  tail -5 "$LOG_DIR/memcheck.log"
  grep -E "ERROR SUMMARY" "$LOG_DIR/memcheck.log" || true
  [ $rc -eq 0 ] || { echo "MEMCHECK FAILED (rc=$rc)"; status=1; }
else
  echo "compute-sanitizer not found; memcheck NOT run"
  status=1
fi

NUM_GPUS=$(nvidia-smi -L | wc -l)
if [ "$NUM_GPUS" -ge 2 ]; then
  step "amax reduction over NCCL: torchrun, 2 processes x 1 GPU"
  rm -rf "$LOG_DIR/amax_nccl"
  if torchrun --standalone --nproc_per_node=2 tests/pytorch/distributed/run_amax_reduction.py \
      --backend nccl --out "$LOG_DIR/amax_nccl" >"$LOG_DIR/amax_nccl.log" 2>&1 &&
     "$PYTHON" -P tests/pytorch/distributed/run_amax_reduction.py --check 2 --out "$LOG_DIR/amax_nccl"; then
    echo "NCCL amax reduction passed"
  else
    tail -30 "$LOG_DIR/amax_nccl.log"; echo "NCCL AMAX REDUCTION FAILED"; status=1
  fi
else
  echo "only $NUM_GPUS GPU: the NCCL amax reduction (2 processes x 1 GPU) did NOT run"
fi

if [ "${SKIP_BENCHMARK:-0}" != "1" ]; then
  step "quantize benchmark"
  "$PYTHON" -P benchmarks/quantize/benchmark_quantize.py --json "$LOG_DIR/benchmark_quantize.json" \
    2>&1 | tee "$LOG_DIR/benchmark_quantize.log" || status=1
  if [ "$NUM_GPUS" -ge 2 ]; then
    step "tensor-parallel LayerNormMLP benchmark (TP=2, with the unoverlapped baseline and the ub_* flags)"
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 \
      benchmarks/parallel/benchmark_tp_mlp.py --overlap-baseline --ub \
      --json "$LOG_DIR/benchmark_tp_mlp.json" 2>&1 | tee "$LOG_DIR/benchmark_tp_mlp.log" || status=1
  fi
fi

echo
[ $status -eq 0 ] && echo "GPU job passed" || echo "GPU job FAILED"
exit $status
