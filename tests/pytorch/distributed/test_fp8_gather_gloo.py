"""FP8 all-gather under sequence parallelism over 2 gloo processes on the CPU (run_fp8_gather.py
holds the checks: bytes equal to the cast after a high-precision gather, uint8 on the wire,
and the sequence-parallel models bitwise equal to the high-precision-gather path), plus the
single-process behaviour of ``gather_along_first_dim`` with a quantizer. NCCL variant: two
GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from utils import needs_two_gpus

from transformer_engine.pytorch import distributed as ted
from transformer_engine.pytorch._tensor_parallel import gathers_fp8
from transformer_engine.pytorch.tensor.float8_tensor import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_fp8_gather as harness  # noqa: E402
from tp_harness import check_gloo_run, run_torchrun  # noqa: E402


def test_fp8_gather_equals_the_high_precision_gather(tmp_path):
    check_gloo_run(harness.worker, tmp_path, 4 + len(harness.MODEL_CASES))


def test_which_quantizers_gather_fp8():
    scale, amax = torch.ones(1), torch.zeros(1)
    assert gathers_fp8(Float8Quantizer(scale, amax, torch.float8_e4m3fn))
    assert gathers_fp8(Float8CurrentScalingQuantizer(torch.float8_e4m3fn))
    assert not gathers_fp8(None)
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    assert not gathers_fp8(MXFP8Quantizer(torch.float8_e4m3fn))


def test_one_rank_quantizes_without_communication():
    x = torch.randn(4, 16)
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    out, handle = ted.gather_along_first_dim(x, None, quantizer=q)
    assert handle is None
    want = Float8CurrentScalingQuantizer(torch.float8_e4m3fn).quantize(x)
    assert torch.equal(out._data, want._data) and torch.equal(out._scale_inv, want._scale_inv)


@needs_two_gpus
def test_fp8_gather_over_nccl(tmp_path):
    run_torchrun("run_fp8_gather.py", tmp_path)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
