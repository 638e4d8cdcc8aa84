"""general_gemm with high-precision operands (BF16, FP16, FP32), and mixed GEMMs where one
operand is FP8 and is dequantized, on CPU: numerics per layout, bias, alpha, FP32 output,
accumulation, and the shapes FP8 GEMMs cannot take. The same on CUDA is in test_gemm_gpu.py."""

from __future__ import annotations

import pytest
import torch
from gemm_helpers import (
    BF16,
    E4M3,
    E5M2,
    FP16,
    FP32,
    LAYOUTS,
    SHAPES,
    fp8_operand,
    operands,
    randn,
    reference_gemm,
)
from tolerances import assert_close_by_table

from transformer_engine.pytorch.cpp_extensions import general_gemm

# ---------------------------------------------------------------------------------------------
# High precision and mixed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_high_precision_gemm(layout, dtype):
    a, b = operands(layout)
    a_hp, b_hp = a.to(dtype), b.to(dtype)
    out = general_gemm(a_hp, b_hp, layout=layout)[0]
    assert out.dtype == dtype and out.shape == SHAPES[layout][2]
    assert_close_by_table(out, reference_gemm(layout, a_hp, b_hp), ("same_values", dtype))
    if dtype != FP32:
        row = "bf16" if dtype == BF16 else "fp16"
        assert_close_by_table(out, reference_gemm(layout, a, b), (row, dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_high_precision_with_bias_alpha_and_fp32_out(layout):
    a, b = operands(layout)
    a_hp, b_hp = a.to(BF16), b.to(BF16)
    bias = randn((SHAPES[layout][2][-1],), 2, dtype=BF16)
    out = general_gemm(a_hp, b_hp, FP32, layout=layout, bias=bias, alpha=2.0)[0]
    assert out.dtype == FP32
    expected = 2.0 * reference_gemm(layout, a_hp, b_hp) + bias.float()
    # Float32 output: BF16 operands are upcast, so only float32 accumulation order differs.
    assert_close_by_table(out, expected, ("same_values", FP32))


def test_high_precision_accumulate_into_fp32():
    a, b = operands("NT")
    a_hp, b_hp = a.to(BF16), b.to(BF16)
    main_grad = randn((40, 48), 3)
    before = main_grad.clone()
    general_gemm(a_hp, b_hp, layout="NT", out=main_grad, accumulate=True)
    assert_close_by_table(
        main_grad, before + reference_gemm("NT", a_hp, b_hp), ("same_values", FP32)
    )


@pytest.mark.parametrize("fp8_side", ["A", "B"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
def test_mixed_gemm_dequantizes_the_fp8_operand(layout, fp8_side, dtype):
    a, b = operands(layout)
    a_hp, b_hp = a.to(dtype), b.to(dtype)
    if fp8_side == "A":
        # Only the columnwise copy for A in TN: mixed GEMMs read whichever buffer exists.
        qa, da = fp8_operand(a, E4M3, rowwise=layout != "TN")
        out = general_gemm(qa, b_hp, layout=layout)[0]
        expected = general_gemm(da.to(dtype), b_hp, layout=layout)[0]
    else:
        qb, db = fp8_operand(b, E5M2)
        out = general_gemm(a_hp, qb, layout=layout)[0]
        expected = general_gemm(a_hp, db.to(dtype), layout=layout)[0]
    assert out.dtype == dtype  # default: the high-precision operand's dtype
    assert torch.equal(out, expected)


def test_mixed_gemm_takes_shapes_fp8_gemms_cannot():
    # No multiple-of-16 rule once the FP8 operand is dequantized.
    qa, da = fp8_operand(randn((24, 20), 0), E4M3)
    b = randn((3, 20), 1, dtype=BF16)
    out = general_gemm(qa, b)[0]
    assert_close_by_table(out, reference_gemm("TN", da.to(BF16), b), ("same_values", BF16))
