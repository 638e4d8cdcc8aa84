"""FP8 all-gather of block-scaled tensors (``Float8BlockScaling``, MXFP8) under sequence
parallelism over 2 gloo processes on the CPU (run_block_gather.py holds the checks: bytes and
scales equal to the cast of the gathered tensor, padding included, ``uint8`` on the wire or the
high-precision fallback when blocks straddle ranks, the sequence-parallel models bitwise equal
to the high-precision-gather path, the saved shard smaller), plus the single-process rules.
NCCL variant: two GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from utils import needs_two_gpus

from transformer_engine.pytorch._block_gather import gathers_exactly
from transformer_engine.pytorch._tensor_parallel import gathers_block_fp8, gathers_fp8
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer
from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run_block_gather as harness  # noqa: E402
from tp_harness import check_gloo_run, run_torchrun  # noqa: E402


def test_block_gather_equals_the_cast_of_the_gathered_tensor(tmp_path):
    cases = harness.DIRECT_CASES + len(harness.MODEL_CASES) + 4
    check_gloo_run(harness.worker, tmp_path, cases)


def _float8(dim):
    return Float8BlockQuantizer(
        torch.float8_e4m3fn, rowwise=True, columnwise=True, block_scaling_dim=dim
    )


def test_which_quantizers_gather_block_fp8():
    assert gathers_block_fp8(_float8(1)) and gathers_block_fp8(MXFP8Quantizer(torch.float8_e4m3fn))
    assert not gathers_block_fp8(Float8CurrentScalingQuantizer(torch.float8_e4m3fn))
    assert not gathers_block_fp8(None)
    assert not gathers_fp8(_float8(1))


@pytest.mark.parametrize(
    ("quantizer", "block", "rowwise_spans"),
    [
        (_float8(1), 128, False),
        (_float8(2), 128, True),
        (MXFP8Quantizer(torch.float8_e4m3fn), 32, False),
        (MXFP8Quantizer(torch.float8_e4m3fn, with_2d_quantization=True), 32, True),
    ],
)
def test_exactness_rule(quantizer, block, rowwise_spans):
    # A block spanning rows needs each rank's rows (all dims but the last) to be whole blocks.
    for shape, whole in (((block, 40), True), ((block // 2, 2, 40), True), ((6, 40), False)):
        assert gathers_exactly(quantizer, shape, rowwise=False, columnwise=True) == whole
        want_row = whole or not rowwise_spans
        assert gathers_exactly(quantizer, shape, rowwise=True, columnwise=False) == want_row
        assert gathers_exactly(quantizer, shape, rowwise=True, columnwise=True) == whole
    # A 1-D tensor's dim 0 is its features; an empty one has nothing to gather.
    assert not gathers_exactly(quantizer, (block * 4,), rowwise=True, columnwise=False)
    assert not gathers_exactly(quantizer, (0, 40), rowwise=True, columnwise=False)


@needs_two_gpus
def test_block_gather_over_nccl(tmp_path):
    run_torchrun("run_block_gather.py", tmp_path)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
