"""CPU tests of the cast kernel wrappers in transformer_engine.pytorch.cpp_extensions:
quantize (bit-for-bit numerics, scale_inv and amax, the in-place buffer contract, the no-op flag,
non-contiguous input, the transposed shape), dequantize, compute_amax and
compute_scale_from_amax.

On CPU every wrapper validates its arguments and then runs the reference
(transformer_engine.pytorch.reference). Expected values come from tests/pytorch/fp8_oracle.py,
which shares no code with the reference (taking them from the reference would compare it with
itself).
"""

from __future__ import annotations

import fp8_oracle as oracle
import pytest
import torch
from cast_wrappers_helpers import (
    E4M3,
    E5M2,
    HP,
    INF,
    NAN,
    _filled_buffers,
    _no_warnings_on_cpu,  # noqa: F401 (autouse fixture)
    _snapshot,
    _unchanged,
    sample,
)
from utils import float32_bits, uint8_view

from transformer_engine.pytorch import cpp_extensions as ext
from transformer_engine.pytorch.constants import DType, to_torch_fp8_dtype

# ---------------------------------------------------------------- quantize: routing and buffers


@pytest.mark.parametrize("fp8", [E4M3, E5M2, DType.kFloat8E4M3, DType.kFloat8E5M2, 7, 8])
@pytest.mark.parametrize("in_dtype", HP)
@pytest.mark.parametrize("with_transpose", [False, True])
def test_quantize_matches_the_oracle_bitwise(fp8, in_dtype, with_transpose):
    x = sample(dtype=in_dtype)
    torch_dtype = to_torch_fp8_dtype(fp8)
    scale = torch.tensor([0.7])
    amax = torch.zeros(1)
    res = ext.quantize(x, scale, fp8, amax=amax, with_transpose=with_transpose)
    assert isinstance(res, ext.QuantizeResult)
    expected = oracle.cast_bytes(x, scale, torch_dtype)
    assert res.data.dtype == torch_dtype and res.data.shape == x.shape
    assert torch.equal(uint8_view(res.data), expected)
    if with_transpose:
        assert res.transpose.shape == (5, 2, 3) and res.transpose.dtype == torch_dtype
        expected_t = oracle.transpose_last_dim_first(expected)
        assert torch.equal(uint8_view(res.transpose), expected_t)
    else:
        assert res.transpose is None
    assert torch.equal(float32_bits(res.scale_inv), float32_bits(oracle.reciprocal(scale)))
    assert torch.equal(float32_bits(amax), float32_bits(oracle.amax(x)))


def test_quantize_python_number_scale():
    x = sample()
    a = ext.quantize(x, 3.5, E4M3)
    b = ext.quantize(x, torch.tensor([3.5]), E4M3)
    assert torch.equal(uint8_view(a.data), uint8_view(b.data))
    assert (
        a.scale_inv.item()
        == b.scale_inv.item()
        == float(torch.tensor(1 / 3.5, dtype=torch.float32))
    )


@pytest.mark.parametrize("buf_dtype", [E4M3, torch.uint8])
def test_quantize_fills_provided_buffers_in_place(buf_dtype):
    x = sample()
    scale = torch.tensor([3.0])
    out = torch.full(x.shape, 0x55, dtype=torch.uint8).view(buf_dtype)
    out_t = torch.full((5, 2, 3), 0x55, dtype=torch.uint8).view(buf_dtype)
    amax = torch.zeros(1)
    scale_inv = torch.full((1,), -1.0)
    ptrs = [t.data_ptr() for t in (out, out_t, amax, scale_inv)]
    res = ext.quantize(x, scale, E4M3, amax=amax, scale_inv=scale_inv, out=out, out_transpose=out_t)
    assert res.data is out and res.transpose is out_t and res.scale_inv is scale_inv
    assert [t.data_ptr() for t in (out, out_t, amax, scale_inv)] == ptrs
    ref = oracle.cast_bytes(x, scale, E4M3)
    assert torch.equal(uint8_view(out), ref)
    assert torch.equal(uint8_view(out_t), oracle.transpose_last_dim_first(ref))
    assert scale_inv.item() == float(torch.tensor(1.0) / torch.tensor(3.0))
    assert amax.item() == oracle.amax(x).item()


def test_quantize_scale_inv_is_reciprocal_of_scale():
    for s in (1.0, 3.0, 0.1, 448.0 / 7, 2.0**-30):
        st = torch.tensor([s])
        res = ext.quantize(torch.ones(4), st, E5M2)
        assert torch.equal(float32_bits(res.scale_inv), float32_bits(torch.ones(1) / st))


def test_quantize_amax_is_max_accumulated():
    amax = torch.zeros(1)
    for values, expected in [([1.0, -3.0], 3.0), ([2.0, NAN], 3.0), ([-5.0], 5.0), ([0.5], 5.0)]:
        ext.quantize(torch.tensor(values), 1.0, E4M3, amax=amax)
        assert amax.item() == expected
    big = torch.tensor([10.0])
    ext.quantize(torch.tensor([4.0]), 1.0, E4M3, amax=big)
    assert big.item() == 10.0
    # a [1]-shaped view into a history row (how Float8Quantizer aliases row 0) accumulates in place
    history = torch.zeros(2, 3)
    ext.quantize(torch.tensor([-7.0]), 1.0, E4M3, amax=history[0][1].reshape(1))
    assert torch.equal(history, torch.tensor([[0.0, 7.0, 0.0], [0.0, 0.0, 0.0]]))


def test_noop_flag_one_writes_nothing():
    x = sample()
    bufs = _filled_buffers(x)
    snap = _snapshot(bufs)
    ext.quantize(x, 2.0, E4M3, noop_flag=torch.tensor([1.0]), **bufs)
    assert _unchanged(bufs, snap)
    res = ext.quantize(x, 2.0, E4M3, noop_flag=torch.ones(1), with_transpose=True)
    assert res.data.shape == x.shape and res.transpose.shape == (5, 2, 3)


def test_noop_flag_zero_runs_normally():
    x = sample()
    bufs = _filled_buffers(x)
    res = ext.quantize(x, 2.0, E4M3, noop_flag=torch.tensor([0.0]), **bufs)
    ref = oracle.cast_bytes(x, 2.0, E4M3)
    assert torch.equal(uint8_view(res.data), ref)
    ref_t = oracle.transpose_last_dim_first(ref)
    assert torch.equal(uint8_view(bufs["out_transpose"]), ref_t)
    assert bufs["amax"].item() == oracle.amax(x).item()
    assert bufs["scale_inv"].item() == 0.5


def test_non_contiguous_input():
    base = sample((5, 4), seed=3)
    x = base.t()
    assert not x.is_contiguous()
    res = ext.quantize(x, 1.5, E5M2, with_transpose=True)
    ref = oracle.cast_bytes(x, 1.5, E5M2)
    assert res.data.shape == (4, 5)
    assert torch.equal(uint8_view(res.data), ref)
    # the transposed copy of x is base's layout
    assert torch.equal(uint8_view(res.transpose), ref.t())
    d = ext.dequantize(res.data.t(), res.scale_inv)
    expected_d = oracle.dequantize(res.data.t(), res.scale_inv, torch.float32, E5M2)
    assert same_bits_or_both_nan(d, expected_d)
    assert ext.compute_amax(x).item() == oracle.amax(base).item()


def test_transposed_shape():
    assert ext.transposed_shape((2, 3, 4)) == (4, 2, 3)
    assert ext.transposed_shape((7,)) == (7,)
    with pytest.raises(ValueError, match="0-d"):
        ext.transposed_shape(())


# ---------------------------------------------------------------- dequantize, amax, current scaling


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("out_dtype", HP)
def test_dequantize_matches_the_oracle(fp8, out_dtype):
    data = torch.arange(256, dtype=torch.uint8).reshape(16, 16).view(fp8)
    s = torch.tensor([0.37])
    got = ext.dequantize(data, s, out_dtype)
    exp = oracle.dequantize(data, s, out_dtype, fp8)
    assert got.dtype == out_dtype
    assert same_bits_or_both_nan(got, exp)
    out = torch.zeros(16, 16, dtype=out_dtype)
    assert ext.dequantize(data, s, out_dtype, out=out) is out
    assert torch.equal(out.view(torch.uint8), got.view(torch.uint8))


def same_bits_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that NaN payloads are free (the contract fixes only FP8 NaN bytes)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(
        a[~nan].view(torch.uint8), b[~nan].view(torch.uint8)
    )


def test_dequantize_default_dtype_is_float32():
    data = torch.tensor([0x38, 0xB8], dtype=torch.uint8).view(E4M3)
    out = ext.dequantize(data, torch.tensor([0.5]))
    assert out.dtype == torch.float32 and out.tolist() == [0.5, -0.5]


@pytest.mark.parametrize("in_dtype", HP)
def test_compute_amax_overwrites_out(in_dtype):
    x = sample(dtype=in_dtype)
    assert torch.equal(ext.compute_amax(x), oracle.amax(x))
    out = torch.tensor([1e9])
    assert ext.compute_amax(x, out=out) is out
    assert out.item() == oracle.amax(x).item()  # written over, not max-accumulated
    assert ext.compute_amax(torch.empty(0, 3)).item() == 0.0


@pytest.mark.parametrize("amax", [0.0, 2.0, 3.0, 1e-3, 1e-40, INF, NAN, 1e6])
@pytest.mark.parametrize("fp8", [E4M3, E5M2, DType.kFloat8E5M2])
@pytest.mark.parametrize("eps,pow2", [(0.0, False), (0.0, True), (1e-2, False), (1.0, True)])
def test_compute_scale_from_amax_matches_the_oracle(amax, fp8, eps, pow2):
    a = torch.tensor([amax])
    got = ext.compute_scale_from_amax(a, fp8, epsilon=eps, force_pow_2_scales=pow2)
    exp = oracle.scale_from_amax(a, to_torch_fp8_dtype(fp8), eps, pow2)
    assert got.dtype == torch.float32 and got.shape == (1,)
    assert torch.equal(float32_bits(got), float32_bits(exp))
    out = torch.tensor([-1.0])
    assert ext.compute_scale_from_amax(a, fp8, epsilon=eps, force_pow_2_scales=pow2, out=out) is out
    assert torch.equal(float32_bits(out), float32_bits(exp))


@pytest.mark.parametrize("eps", [-1e-3, INF, NAN])
def test_compute_scale_rejects_bad_epsilon(eps):
    out = torch.tensor([-1.0])
    with pytest.raises(ValueError, match="epsilon"):
        ext.compute_scale_from_amax(torch.tensor([2.0]), E4M3, epsilon=eps, out=out)
    assert out.item() == -1.0


def test_compute_scale_rejects_bad_tensors():
    with pytest.raises(TypeError, match="amax must be float32"):
        ext.compute_scale_from_amax(torch.tensor([2.0], dtype=torch.float64), E4M3)
    with pytest.raises(ValueError, match="exactly one element"):
        ext.compute_scale_from_amax(torch.tensor([2.0, 3.0]), E4M3)
    with pytest.raises(TypeError, match="not an FP8 format"):
        ext.compute_scale_from_amax(torch.tensor([2.0]), torch.float16)
    with pytest.raises(ValueError, match="meta"):
        ext.compute_scale_from_amax(torch.tensor([2.0]), E4M3, out=torch.empty(1, device="meta"))
