"""A column-parallel GEMM's backward issues its collectives asynchronously and runs a GEMM
while each is in flight (2 gloo processes on the CPU; run_backward_overlap.py records the
events and holds the checks). The NCCL variant needs two GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

from utils import needs_two_gpus

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_backward_overlap as harness  # noqa: E402
from tp_harness import check_gloo_run, run_torchrun  # noqa: E402


def test_backward_collectives_overlap_the_gemms(tmp_path):
    check_gloo_run(harness.worker, tmp_path, len(harness.CASES))


@needs_two_gpus
def test_backward_collectives_overlap_the_gemms_over_nccl(tmp_path):
    run_torchrun("run_backward_overlap.py", out_dir=tmp_path)
