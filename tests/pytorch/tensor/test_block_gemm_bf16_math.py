"""The emulated block-scaled GEMMs' BF16 math on the CPU (cpp_extensions/block_gemm.py for
Float8BlockScaling, mxfp8_gemm.py for MXFP8).

With power-of-two scales (MXFP8's E8M0 always) every dequantized operand value is a BF16 number, so oneDNN's BF16
math mode multiplies them exactly, as plain float32 does; only the float32 accumulation order
differs. The mode flushes subnormals to zero, so it must be refused where an operand value, a
product or a partial sum could be subnormal, or a sum could overflow, and with non-power-of-two
scales. Oracle: the float64 product of the dequantized operands, within the float32
accumulation bound ``(K + 2) * 2**-24 * (|X| @ |Y|^T)``.
"""

import pytest
import torch

from transformer_engine.pytorch.cpp_extensions import block_gemm, fp8_gemm_cpu
from transformer_engine.pytorch.cpp_extensions.gemm import general_gemm
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16_MATH_AVAILABLE = fp8_gemm_cpu._onednn_has_bf16_math()


def quantize(values, dim, pow2, dtype=E4M3):
    quantizer = Float8BlockQuantizer(
        dtype, rowwise=True, columnwise=True, block_scaling_dim=dim, force_pow_2_scales=pow2
    )
    return quantizer(values)


def record_math_modes(monkeypatch):
    """Replaces torch.mm by a wrapper recording oneDNN's float32 math mode at each call."""
    seen = []
    plain_mm = torch.mm

    def recording_mm(*args, **kwargs):
        seen.append(torch.backends.mkldnn.matmul.fp32_precision)
        return plain_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", recording_mm)
    return seen


def assert_within_accumulation_bound(out, x, y):
    """``out`` against ``x @ y^T`` in float64 (``x``, ``y`` the dequantized operands)."""
    xd, yd = x.double(), y.double()
    exact = xd @ yd.t()
    bound = (x.shape[1] + 2) * 2.0**-24 * (xd.abs() @ yd.abs().t())
    assert bool(((out.double() - exact).abs() <= bound).all())


def use_math_mode(monkeypatch, bf16_math: bool) -> None:
    """The emulated GEMMs in BF16 math (skipped where this CPU / torch lacks it) or in plain
    float32, with the default thread rule whatever the environment says."""
    if bf16_math and not BF16_MATH_AVAILABLE:
        pytest.skip("oneDNN has no BF16 math mode on this CPU / torch")
    monkeypatch.setattr(fp8_gemm_cpu, "USE_BF16_MATH", bf16_math)
    monkeypatch.setattr(fp8_gemm_cpu, "BF16_MATH_SETTING", "auto")
    # the rule's premise, one Python thread, whatever threads earlier tests of the process left
    # running (torch.compile starts tqdm's monitor thread, which lives on)
    monkeypatch.setattr(fp8_gemm_cpu.threading, "active_count", lambda: 1)


def gemm_in_recorded_mode(monkeypatch, a, b, layout, ref_x, ref_y, expected_mode: str) -> None:
    """``general_gemm(a, b)`` in float32 within the accumulation bound of ``ref_x @ ref_y^T``,
    with one GEMM in ``expected_mode`` ("bf16", or "before": the mode found before) and the
    mode restored afterwards."""
    before = torch.backends.mkldnn.matmul.fp32_precision
    seen = record_math_modes(monkeypatch)
    out = general_gemm(a, b, torch.float32, layout=layout)[0]
    assert_within_accumulation_bound(out, ref_x, ref_y)
    assert seen == [before if expected_mode == "before" else expected_mode]
    assert torch.backends.mkldnn.matmul.fp32_precision == before


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32_scales"])
@pytest.mark.parametrize("bf16_math", [True, False], ids=["bf16_math", "float32_math"])
@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_emulated_block_gemm_meets_the_float64_bound_in_either_mode(
    layout, bf16_math, pow2, monkeypatch
):
    use_math_mode(monkeypatch, bf16_math)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(192, 256, generator=g) * torch.exp2(torch.randint(-6, 6, (192, 1), generator=g))
    w = torch.randn(160, 256, generator=g)
    dy = torch.randn(192, 160, generator=g) * 1e-3
    xq, wq, dyq = quantize(x, 1, pow2), quantize(w, 2, pow2), quantize(dy, 1, pow2)
    # (A, B, which copy of B, which copy of A): X = B's copy, Y = A's copy, out = X @ Y^T.
    a, b, b_columnwise, a_columnwise = {
        "TN": (wq, xq, False, False),
        "NN": (wq, dyq, False, True),
        "NT": (xq, dyq, True, True),
    }[layout]

    def dequantized(operand, columnwise):  # the float32 matrix of the copy the GEMM reads
        values, scale_inv, is_2d = operand.block_float8_gemm_input(columnwise)
        return block_gemm._dequantize(values, scale_inv, is_2d)

    ref_x, ref_y = dequantized(b, b_columnwise), dequantized(a, a_columnwise)
    # BF16 math exactly where it is exact and wanted; the mode is restored afterwards.
    expected = "bf16" if bf16_math and pow2 else "before"
    gemm_in_recorded_mode(monkeypatch, a, b, layout, ref_x, ref_y, expected)


def power_of_two_scales(exponent, shape=(2, 4)):
    return torch.full(shape, 2.0**exponent)


def fp8_operand(dtype, k=256):
    return torch.ones(8, k).to(dtype)


@pytest.mark.parametrize(
    ("x_exp", "y_exp", "dtypes", "exact"),
    [
        (0, 0, (E4M3, E4M3), True),
        (-50, -50, (E4M3, E4M3), True),  # smallest product 2**-118: normal
        (-55, -55, (E4M3, E4M3), False),  # 2**-128: subnormal, BF16 math would flush it
        (-52, -52, (E4M3, E4M3), True),  # 2**-122
        (-52, -52, (E5M2, E4M3), False),  # E5M2's smallest 2**-16: 2**-129
        (-117, 40, (E4M3, E4M3), True),  # operand values down to 2**-126, products normal
        (-118, 40, (E4M3, E4M3), False),  # an operand value 2**-127: subnormal
        (50, 50, (E4M3, E4M3), True),  # 256 products below 2**118 each: below 2**126
        (55, 55, (E4M3, E4M3), False),  # 448**2 * 2**110 * 256 would overflow float32
    ],
)
def test_bf16_math_is_refused_where_it_would_not_be_exact(x_exp, y_exp, dtypes, exact):
    x, y = fp8_operand(dtypes[0]), fp8_operand(dtypes[1])
    got = block_gemm._bf16_math_is_exact(
        x, power_of_two_scales(x_exp), y, power_of_two_scales(y_exp)
    )
    assert got is exact


def test_bf16_math_needs_normal_power_of_two_scales():
    x = fp8_operand(E4M3)
    good = power_of_two_scales(0)
    padded = torch.cat([good, torch.zeros(2, 4)], dim=1)  # GEMM_READY padding: zeros, ignored
    assert block_gemm._bf16_math_is_exact(x, padded, x, good)
    for bad in (0.75, float("inf"), float("nan"), 2.0**-130):  # not a power / not normal
        scales = good.clone()
        scales[1, 2] = bad
        assert not block_gemm._bf16_math_is_exact(x, scales, x, good)
        assert not block_gemm._bf16_math_is_exact(x, good, x, scales)


@pytest.mark.parametrize("bf16_math", [True, False], ids=["bf16_math", "float32_math"])
@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_emulated_mxfp8_gemm_meets_the_float64_bound_in_either_mode(layout, bf16_math, monkeypatch):
    # E8M0 scales are powers of two: BF16 math whenever the exponents allow it.
    use_math_mode(monkeypatch, bf16_math)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(96, 128, generator=g) * torch.exp2(torch.randint(-6, 6, (96, 1), generator=g))
    w = torch.randn(64, 128, generator=g)
    dy = torch.randn(96, 64, generator=g) * 1e-3
    quantizer = MXFP8Quantizer(E4M3, rowwise=True, columnwise=True)
    xq, wq, dyq = quantizer(x), quantizer(w), quantizer(dy)
    a, b, b_columnwise, a_columnwise = {
        "TN": (wq, xq, False, False),
        "NN": (wq, dyq, False, True),
        "NT": (xq, dyq, True, True),
    }[layout]
    ref_x = b.mxfp8_gemm_input(b_columnwise).reshape(-1, b.size()[-1])
    ref_y = a.mxfp8_gemm_input(a_columnwise)
    ref_x, ref_y = {"TN": (ref_x, ref_y), "NN": (ref_x, ref_y.t()), "NT": (ref_x.t(), ref_y.t())}[
        layout
    ]
    expected = "bf16" if bf16_math else "before"
    gemm_in_recorded_mode(monkeypatch, a, b, layout, ref_x, ref_y, expected)


def test_mxfp8_bf16_math_is_refused_for_denormal_scales():
    # A block of values below 2**-127 * 448 gets the E8M0 byte 0 (the denormal scale 2**-127):
    # its dequantized values may be subnormal, which BF16 math would flush.
    x = torch.randn(32, 64)
    x[5, :32] = 1e-39
    t = MXFP8Quantizer(E4M3, rowwise=True, columnwise=True)(x)
    assert t.mxfp8_gemm_scale_exponents(False) is None
    assert (
        MXFP8Quantizer(E4M3, rowwise=True, columnwise=True)(
            torch.randn(32, 64)
        ).mxfp8_gemm_scale_exponents(False)
        is not None
    )
