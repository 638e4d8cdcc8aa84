"""Tensor and sequence parallelism of ``te.Linear`` with ``save_original_input``,
``delay_wgrad_compute``, ``fuse_wgrad_accumulation`` and a recipe's ``backward_override``,
over 2 gloo processes on the CPU (run_tensor_parallel_options.py holds the comparisons with
the single-process layers). The NCCL variant needs two GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

from utils import needs_two_gpus

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_tensor_parallel_options as harness  # noqa: E402
from tp_harness import check_gloo_run, run_torchrun  # noqa: E402


def test_parallel_options_equal_the_single_process_layers(tmp_path):
    check_gloo_run(harness.worker, tmp_path, len(harness.CASES))


@needs_two_gpus
def test_parallel_options_over_nccl(tmp_path):
    run_torchrun("run_tensor_parallel_options.py", out_dir=tmp_path)
