"""general_gemm with two FP8 operands (torch._scaled_mm) on CPU: numerics per layout, format pair
and output dtype, the buffers each layout reads, accumulation modes, bias, accumulation into
main_grad, ``out``, alpha, and M that is not a multiple of 16; and the completeness of the GEMM
rows of the tolerance table.

Results are compared twice, with the rows of tests/pytorch/tolerances.py: against a float64
GEMM of the dequantized operands (tight: only accumulation and output rounding differ; row
"fp8_dequantized", which on CPU is met with float32 accuracy since torch._scaled_mm there
accumulates exactly in float32) and against a float64 GEMM of the original high-precision
operands (quantization error; rows "e4m3" and "hybrid"). The same numerics on CUDA are in
test_gemm_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from gemm_helpers import (
    BF16,
    E4M3,
    E5M2,
    FORMAT_IDS,
    FORMATS,
    FP16,
    FP32,
    LAYOUTS,
    OUT_DTYPES,
    SHAPES,
    fp8_operand,
    operands,
    randn,
    reference_gemm,
    usage_for,
)
from tolerances import GEMM_TOLERANCES, assert_close_by_table

from transformer_engine.pytorch.cpp_extensions import float8_gemm_operand as operand_module
from transformer_engine.pytorch.cpp_extensions import general_gemm

# ---------------------------------------------------------------------------------------------
# FP8 x FP8
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize(("a_fmt", "b_fmt", "row"), FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_gemm_matches_dequantized_and_original(layout, a_fmt, b_fmt, row, out_dtype):
    a, b = operands(layout)
    qa, da = fp8_operand(a, a_fmt)
    qb, db = fp8_operand(b, b_fmt)
    out, bias_grad, gelu_input, extra = general_gemm(qa, qb, out_dtype, layout=layout)
    assert (bias_grad, gelu_input, extra) == (None, None, None)
    assert out.dtype == out_dtype
    assert out.shape == SHAPES[layout][2]
    assert_close_by_table(out, reference_gemm(layout, da, db), ("fp8_dequantized", out_dtype))
    assert_close_by_table(out, reference_gemm(layout, a, b), (row, out_dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_gemm_reads_only_the_buffers_its_layout_needs(layout):
    a, b = operands(layout)
    qa, da = fp8_operand(a, E4M3)
    qb, db = fp8_operand(b, E5M2)
    full = general_gemm(qa, qb, FP32, layout=layout)[0]
    a_row, a_col, b_row, b_col = usage_for(layout)
    # Only the needed buffers present: same result.
    qa_min, _ = fp8_operand(a, E4M3, rowwise=a_row, columnwise=a_col)
    qb_min, _ = fp8_operand(b, E5M2, rowwise=b_row, columnwise=b_col)
    assert torch.equal(general_gemm(qa_min, qb_min, FP32, layout=layout)[0], full)
    # The unused buffers poisoned: still the same result (they are never read).
    poisoned = []
    for op, row, col in ((qa, a_row, a_col), (qb, b_row, b_col)):
        p = op
        if not row:
            p = p._replace(
                data=torch.full_like(op.data.view(torch.uint8), 0x7E).view(op.data.dtype)
            )
        if not col:
            p = p._replace(
                transpose=torch.full_like(op.transpose.view(torch.uint8), 0x7E).view(op.data.dtype)
            )
        poisoned.append(p)
    assert torch.equal(general_gemm(*poisoned, FP32, layout=layout)[0], full)


@pytest.mark.parametrize(
    ("layout", "operand", "usage"),
    [
        ("TN", "A", "rowwise"),
        ("TN", "B", "rowwise"),
        ("NN", "A", "columnwise"),
        ("NN", "B", "rowwise"),
        ("NT", "A", "columnwise"),
        ("NT", "B", "columnwise"),
    ],
)
def test_fp8_gemm_missing_buffer_names_the_usage(layout, operand, usage):
    a, b = operands(layout)
    qa, _ = fp8_operand(a, E4M3)
    qb, _ = fp8_operand(b, E4M3)
    field = "data" if usage == "rowwise" else "transpose"
    if operand == "A":
        qa = qa._replace(**{field: None})
    else:
        qb = qb._replace(**{field: None})
    if usage == "rowwise":
        message = f"{operand} has no rowwise FP8 data .*quantize it with rowwise usage"
    else:
        message = (
            f"{operand} has no columnwise \\(transposed\\) FP8 data.*quantize it with "
            "columnwise usage"
        )
    with pytest.raises(ValueError, match=message):
        general_gemm(qa, qb, layout=layout)


def test_fp8_gemm_without_any_buffer_is_refused():
    a, b = operands("TN")
    qa, _ = fp8_operand(a, E4M3, rowwise=False, columnwise=False)
    qb, _ = fp8_operand(b, E4M3)
    with pytest.raises(ValueError, match="A holds no data"):
        general_gemm(qa, qb)


@pytest.mark.parametrize("layout", ["NN", "NT"])
def test_non_tn_devices_serve_columnwise_usage_from_rowwise_data(layout, monkeypatch):
    # Data-center Blackwell keeps no transposed copy; data is transposed on the fly (exact).
    a, b = operands(layout)
    qa, _ = fp8_operand(a, E4M3)
    qb, _ = fp8_operand(b, E5M2)
    expected = general_gemm(qa, qb, FP32, layout=layout)[0]
    qa_row, _ = fp8_operand(a, E4M3, columnwise=False)
    qb_row, _ = fp8_operand(b, E5M2, columnwise=False)
    monkeypatch.setattr(operand_module, "is_non_tn_fp8_gemm_supported", lambda device: True)
    assert torch.equal(general_gemm(qa_row, qb_row, FP32, layout=layout)[0], expected)


def test_fp8_transpose_only_operand_has_its_logical_shape():
    # A B quantized for wgrad only (no row-wise data) still gives the right output shape.
    a, b = operands("NT")
    qa, da = fp8_operand(a, E4M3, rowwise=False)
    qb, db = fp8_operand(b, E5M2, rowwise=False)
    out = general_gemm(qa, qb, FP32, layout="NT")[0]
    assert out.shape == (40, 48)
    assert_close_by_table(out, reference_gemm("NT", da, db), ("fp8_dequantized", FP32))


@pytest.mark.parametrize("split", [False, True], ids=["fast_accum", "split_accum"])
def test_fp8_accumulation_modes_agree_on_cpu(split):
    a, b = operands("TN")
    qa, da = fp8_operand(a, E4M3)
    qb, db = fp8_operand(b, E4M3)
    out = general_gemm(qa, qb, FP32, use_split_accumulator=split)[0]
    assert_close_by_table(out, reference_gemm("TN", da, db), ("fp8_dequantized", FP32))


def test_fp8_default_out_dtype_is_bf16():
    a, b = operands("TN")
    out = general_gemm(fp8_operand(a, E4M3)[0], fp8_operand(b, E4M3)[0])[0]
    assert out.dtype == BF16


@pytest.mark.parametrize("bias_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_fp8_bias_is_added_in_the_output(out_dtype, bias_dtype):
    # Any bias dtype works: a BF16/FP16 bias matching the output goes to torch._scaled_mm,
    # anything else is added in float32 before the single output rounding.
    a, b = operands("TN")
    qa, da = fp8_operand(a, E4M3)
    qb, db = fp8_operand(b, E4M3)
    bias = randn((48,), 7, dtype=bias_dtype)
    out = general_gemm(qa, qb, out_dtype, bias=bias)[0]
    expected = reference_gemm("TN", da, db) + bias.float()
    assert out.dtype == out_dtype
    assert_close_by_table(out, expected, ("fp8_dequantized", out_dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_accumulate_into_fp32_main_grad(layout):
    a, b = operands(layout)
    qa, da = fp8_operand(a, E4M3)
    qb, db = fp8_operand(b, E5M2)
    main_grad = randn(SHAPES[layout][2], 3)
    before = main_grad.clone()
    out = general_gemm(qa, qb, FP32, layout=layout, out=main_grad, accumulate=True)[0]
    assert out is main_grad
    expected = before + reference_gemm(layout, da, db)
    assert_close_by_table(main_grad, expected, ("fp8_dequantized", FP32))
    # Accumulating twice adds twice.
    general_gemm(qa, qb, layout=layout, out=main_grad, accumulate=True)
    assert_close_by_table(
        main_grad, expected + reference_gemm(layout, da, db), ("fp8_dequantized", FP32)
    )


def test_fp8_accumulate_into_bf16_rounds_once():
    a, b = operands("TN")
    qa, da = fp8_operand(a, E4M3)
    qb, db = fp8_operand(b, E4M3)
    out = randn(SHAPES["TN"][2], 4, dtype=BF16)
    before = out.clone()
    bias = randn((48,), 5)
    general_gemm(qa, qb, out=out, accumulate=True, bias=bias, alpha=0.5)
    expected = (before.double() + 0.5 * reference_gemm("TN", da, db).double() + bias.double()).to(
        BF16
    )
    # One rounding of the float32 sum: equal to the correctly rounded value, or one ulp off.
    assert_close_by_table(out, expected, ("fp8_dequantized", BF16))


def test_fp8_out_receives_the_result():
    a, b = operands("NN")
    qa, da = fp8_operand(a, E4M3)
    qb, db = fp8_operand(b, E5M2)
    buffer = torch.full(SHAPES["NN"][2], float("nan"), dtype=FP16)
    out = general_gemm(qa, qb, layout="NN", out=buffer)[0]
    assert out is buffer and out.dtype == FP16  # out_dtype defaults to out.dtype
    assert_close_by_table(buffer, reference_gemm("NN", da, db), ("fp8_dequantized", FP16))


@pytest.mark.parametrize("alpha", [0.5, -3.0, 0.0])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_alpha_scales_the_product_not_the_bias(layout, alpha):
    a, b = operands(layout)
    qa, da = fp8_operand(a, E4M3)
    qb, db = fp8_operand(b, E4M3)
    n = SHAPES[layout][2][-1]
    bias = randn((n,), 9)
    out = general_gemm(qa, qb, FP32, layout=layout, alpha=alpha, bias=bias)[0]
    expected = alpha * reference_gemm(layout, da, db) + bias
    assert_close_by_table(out, expected, ("fp8_dequantized", FP32))


@pytest.mark.parametrize("m", [1, 3, 17, 0])
def test_fp8_m_needs_no_multiple_of_16(m):
    qa, da = fp8_operand(randn((16, 32), 0), E4M3)
    qb, db = fp8_operand(randn((m, 32), 1) if m else torch.ones(0, 32), E4M3)
    out = general_gemm(qa, qb, FP32)[0]
    assert out.shape == (m, 16)
    if m:
        assert_close_by_table(out, reference_gemm("TN", da, db), ("fp8_dequantized", FP32))


def test_tolerance_table_is_complete_for_gemm_tests():
    for out_dtype in OUT_DTYPES:
        for fmt in (
            "same_values",
            "fp8_dequantized",
            "fp8_dequantized_fast_accum",
            "e4m3",
            "hybrid",
        ):
            assert (fmt, out_dtype) in GEMM_TOLERANCES
    with pytest.raises(KeyError, match="no tolerance row"):
        assert_close_by_table(torch.zeros(1), torch.zeros(1), ("e2m1", FP32))
