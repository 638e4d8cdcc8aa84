"""Tensor and sequence parallelism of the fusible operations over 2 gloo processes on the CPU
(``run_ops_tensor_parallel.py`` holds the comparisons with the single-process operations and
their tolerances). The NCCL variant needs two GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

from utils import needs_two_gpus

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_ops_tensor_parallel as harness  # noqa: E402
from tp_harness import check_gloo_run, run_torchrun  # noqa: E402


def test_parallel_operations_equal_the_single_process_operations(tmp_path):
    check_gloo_run(harness.worker, tmp_path, len(harness.CASES) + 1)


@needs_two_gpus
def test_parallel_operations_over_nccl(tmp_path):
    run_torchrun("run_ops_tensor_parallel.py", out_dir=tmp_path)
