"""``general_gemm`` with upstream's whole signature: its argument order, the output quantizer,
``beta`` with ``accumulate`` and the bias gradient of the wgrad layout (CPU; the epilogues are
formed from the GEMM's float32 product on every device).

Operands are small integers, so every product and sum is exact in float32 and the float64
oracle gives the exact values to compare with."""

from __future__ import annotations

import inspect

import pytest
import torch
from gemm_helpers import E4M3, FP32, SHAPES, fp8_operand, reference_gemm
from utils import current_scale, fake_quant

from transformer_engine.pytorch.cpp_extensions import general_gemm
from transformer_engine.pytorch.tensor import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
)

# upstream's order; every argument may be passed by position
UPSTREAM_ARGS = (
    "A", "B", "out_dtype", "quantization_params", "gelu", "gelu_in", "alpha", "beta",
    "accumulate", "layout", "out", "bias", "use_split_accumulator", "grad", "ub", "ub_type",
    "extra_output", "bulk_overlap",
)  # fmt: skip


def small_ints(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).float()


def test_signature_is_upstreams():
    params = inspect.signature(general_gemm).parameters
    assert tuple(params) == UPSTREAM_ARGS
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params.values())
    defaults = {name: p.default for name, p in params.items() if name not in ("A", "B")}
    assert defaults["layout"] == "TN" and defaults["alpha"] == 1.0 and defaults["beta"] is None
    assert defaults["bulk_overlap"] is False and defaults["grad"] is False


@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_positional_alpha(layout):
    a_shape, b_shape, _ = SHAPES[layout]
    a, b = small_ints(a_shape, 1), small_ints(b_shape, 2)
    out = general_gemm(a, b, FP32, None, False, None, 2.0, None, False, layout)[0]
    assert torch.equal(out.double(), 2 * reference_gemm(layout, a.double(), b.double()))


@pytest.mark.parametrize("fp8_operands", [False, True], ids=["plain", "fp8"])
def test_output_quantizer_quantizes_the_product_once(fp8_operands):
    a, b = small_ints((48, 64), 3), small_ints((2, 5, 64), 4)
    if fp8_operands:
        (a, a_values), (b, b_values) = fp8_operand(a, E4M3), fp8_operand(b, E4M3)
        a_values, b_values = a_values.double(), b_values.double()
    else:
        a_values, b_values = a.double(), b.double()
    product = reference_gemm("TN", a_values, b_values).float()
    quantizer = Float8CurrentScalingQuantizer(E4M3, "cpu")
    out = general_gemm(a, b, torch.bfloat16, quantizer)[0]
    assert isinstance(out, Float8Tensor) and out.dtype == torch.bfloat16
    fp8 = torch.float8_e4m3fn  # the oracle's name for the format
    expected = fake_quant(product, current_scale(product, fp8), fp8)
    assert torch.equal(out.dequantize(dtype=torch.float32).double(), expected)
    # into a quantized buffer, in place
    buffer = quantizer.make_empty(product.shape, dtype=torch.float32, device="cpu")
    filled = general_gemm(a, b, None, quantizer, out=buffer)[0]
    assert filled is buffer and torch.equal(buffer.dequantize().double(), expected)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, FP32])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, None])
def test_beta_scales_the_old_output(out_dtype, beta):
    a, b = small_ints((48, 64), 5), small_ints((2, 5, 64), 6)
    old = small_ints((2, 5, 48), 7).to(out_dtype)
    out = old.clone()
    result = general_gemm(a, b, out_dtype, beta=beta, accumulate=True, out=out, alpha=0.5)[0]
    factor = 1.0 if beta is None else beta
    expected = factor * old.double() + 0.5 * reference_gemm("TN", a.double(), b.double())
    assert result is out and torch.equal(out.double(), expected.to(out_dtype).double())


@pytest.mark.parametrize("fp8_grad", [False, True], ids=["plain", "fp8"])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, FP32])
def test_wgrad_bias_gradient(fp8_grad, bias_dtype):
    """NT (wgrad): ``B`` is the output gradient ``[..., M]``; the bias gradient is its sum over
    every row, in the bias's dtype, and no bias is added to the weight gradient."""
    a_shape, b_shape, _ = SHAPES["NT"]
    a, b = small_ints(a_shape, 8), small_ints(b_shape, 9)
    b_values = b.double()
    if fp8_grad:  # a Float8Tensor (scale 1: small integers stay exact), dequantized to sum
        b = Float8Quantizer(torch.ones(1), torch.zeros(1), E4M3)(b)
        b_values = b.dequantize(dtype=torch.float32).double()
    flag = torch.full((b_shape[-1],), 100.0, dtype=bias_dtype)
    dw, dbias, gelu_in, extra = general_gemm(a, b, FP32, layout="NT", bias=flag, grad=True)
    assert gelu_in is None and extra is None
    assert torch.equal(dw.double(), reference_gemm("NT", a.double(), b_values))
    assert dbias.dtype == bias_dtype
    assert torch.equal(dbias.double(), b_values.reshape(-1, b_shape[-1]).sum(0))


def test_refusals_leave_the_output_untouched():
    a, b = small_ints((48, 64), 10), small_ints((2, 5, 64), 11)
    out = torch.full((2, 5, 48), 7.0)
    quantizer = Float8CurrentScalingQuantizer(E4M3, "cpu")
    with pytest.raises(ValueError, match="output quantizer would add into quantized"):
        general_gemm(a, b, None, quantizer, accumulate=True, out=out)
    with pytest.raises(TypeError, match="out must be a quantized tensor"):
        general_gemm(a, b, None, quantizer, out=out)
    with pytest.raises(TypeError, match="output quantizer must be None or"):
        general_gemm(a, b, None, "fp8")
    with pytest.raises(NotImplementedError, match="extra_output"):
        general_gemm(a, b, out=out, extra_output=torch.empty(1))
    with pytest.raises(NotImplementedError, match="bulk_overlap=True"):
        general_gemm(a, b, out=out, bulk_overlap=True)
    assert torch.equal(out, torch.full((2, 5, 48), 7.0))
