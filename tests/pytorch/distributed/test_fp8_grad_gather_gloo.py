"""FP8 gathers in backward under sequence parallelism over 2 gloo processes on the CPU
(run_fp8_grad_gather.py holds the checks: a row-parallel layer's output gradient gathered as
FP8 bytes and a column-parallel layer's saved FP8 shard gathered again, both equal to the
single-process cast, uint8 on the wire, the models bitwise equal to the high-precision-gather
path, and the saved bytes of a column-parallel layer cut to the local shard). NCCL variant:
two GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from utils import needs_two_gpus

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_fp8_grad_gather as harness  # noqa: E402
from tp_harness import check_gloo_run, run_torchrun  # noqa: E402


def test_fp8_backward_gathers_equal_the_high_precision_path(tmp_path):
    check_gloo_run(harness.worker, tmp_path, harness.DIRECT_CASES + len(harness.MODEL_CASES) + 6)


@needs_two_gpus
def test_fp8_backward_gathers_over_nccl(tmp_path):
    run_torchrun("run_fp8_grad_gather.py", tmp_path)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
