"""Communication/GEMM overlap (``ub_*`` flags after ``te.initialize_ub``) gives the results of
the unpipelined tensor-parallel model and runs its collectives chunk by chunk with the GEMMs
(2 and 3 gloo processes on the CPU; run_comm_gemm_overlap.py holds the checks). The NCCL
variant needs two GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from utils import needs_two_gpus

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_comm_gemm_overlap as harness  # noqa: E402
from tp_harness import check_gloo_run, run_torchrun  # noqa: E402


@pytest.mark.parametrize("world_size", [2, 3])
def test_pipelined_collectives_match_the_plain_model(tmp_path, world_size):
    check_gloo_run(harness.worker, tmp_path, len(harness.CASES), world_size=world_size)


@needs_two_gpus
def test_pipelined_collectives_match_the_plain_model_over_nccl(tmp_path):
    run_torchrun("run_comm_gemm_overlap.py", out_dir=tmp_path)
