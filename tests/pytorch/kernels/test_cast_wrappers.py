"""CPU tests of the kernel wrappers in transformer_engine.pytorch.cpp_extensions.

On CPU every wrapper validates its arguments and then runs the reference
(transformer_engine.pytorch.reference). Expected values come from tests/pytorch/fp8_oracle.py,
which shares no code with the reference (taking them from the reference would compare it with
itself); these tests pin the numerics bit for bit, the in-place buffer contract, and the
validation errors.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import fp8_oracle as oracle
import pytest
import torch
from utils import REPO_ROOT, float32_bits, uint8_view

import transformer_engine
from transformer_engine.pytorch import cpp_extensions as ext
from transformer_engine.pytorch.constants import (
    DType,
    TE_DType,
    TE_DType_To_Torch,
    fp8_max,
    to_torch_fp8_dtype,
)
from transformer_engine.pytorch.device import check_same_device, reject_meta

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
HP = (torch.float32, torch.float16, torch.bfloat16)
NAN, INF = math.nan, math.inf


def sample(shape=(2, 3, 5), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 100
    flat = x.view(-1)
    flat[:4] = torch.tensor([NAN, INF, -INF, -0.0])
    return x.to(dtype)


@pytest.fixture(autouse=True)
def _no_warnings_on_cpu():
    # CPU tensors run the reference by design: no fallback warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


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


def _filled_buffers(x):
    return dict(
        out=torch.full(x.shape, 0x11, dtype=torch.uint8).view(E4M3),
        out_transpose=torch.full((x.shape[-1], *x.shape[:-1]), 0x22, dtype=torch.uint8).view(E4M3),
        amax=torch.tensor([0.25]),
        scale_inv=torch.tensor([-2.0]),
    )


def _snapshot(bufs):
    return {k: v.clone() for k, v in bufs.items()}


def _unchanged(bufs, snap):
    return all(torch.equal(uint8_view(bufs[k]), uint8_view(snap[k])) for k in bufs)


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


# ---------------------------------------------------------------- delayed scaling


def _update_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    hists = [
        torch.rand(4, 3, generator=g) * 10,
        torch.rand(4, 2, generator=g) * 10,
        torch.rand(1, 2, generator=g),
    ]
    hists[0][0, 1] = 0.0  # an unexercised slot
    hists[1][2, 0] = NAN
    scales = [torch.rand(h.shape[1], generator=g) + 0.5 for h in hists]
    buf = torch.tensor([0.0, 3.0, 0.0, 20.0, 0.0, 1e-38, 0.0])
    return hists, scales, buf


def _clone(seq):
    return [t.clone() for t in seq]


def _all_equal(a, b):
    return all(torch.equal(float32_bits(x), float32_bits(y)) for x, y in zip(a, b))


@pytest.mark.parametrize("fp8", [E4M3, E5M2, DType.kFloat8E4M3])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0.0, 1.5])
@pytest.mark.parametrize("use_buf", [False, True])
def test_delayed_scaling_update_matches_the_oracle(fp8, algo, margin, use_buf):
    hists, scales, buf = _update_state()
    buf = buf if use_buf else None
    fh, fs = _clone(hists), _clone(scales)
    ptrs = [t.data_ptr() for t in hists + scales]
    before = _clone(hists)
    ext.delayed_scaling_update(
        hists, scales, fp8, margin=margin, amax_compute_algo=algo, amax_reduction_buffer=buf
    )
    # fh and fs still hold the state before the update (the fused entry runs on them below).
    model_h, model_s = [h.tolist() for h in fh], [s.tolist() for s in fs]
    fp8_max = oracle.FP8_FORMATS[to_torch_fp8_dtype(fp8)][2]
    reduced = buf.tolist() if buf is not None else None
    oracle.delayed_scaling_update_model(model_h, model_s, fp8_max, margin, algo, reduced)
    rh = [torch.tensor(h, dtype=torch.float32) for h in model_h]
    rs = [torch.tensor(s, dtype=torch.float32) for s in model_s]
    assert [t.data_ptr() for t in hists + scales] == ptrs  # updated in place
    assert _all_equal(hists, rh) and _all_equal(scales, rs)
    assert not _all_equal(hists, before)  # something actually happened
    ext.fused_amax_and_scale_update_after_reduction(buf, fh, fs, algo, fp8, margin)
    assert _all_equal(fh, rh) and _all_equal(fs, rs)


def test_delayed_scaling_update_empty_is_noop():
    ext.delayed_scaling_update([], [], E4M3)
    ext.fused_amax_and_scale_update_after_reduction(None, [], [], "max", E4M3, 0.0)


def _bad_update(kind):
    """(args, kwargs) for delayed_scaling_update with one defect, plus the expected error."""
    hists, scales, buf = _update_state()
    kw = dict(margin=0.0, amax_compute_algo="max", amax_reduction_buffer=buf)
    fp8 = E4M3
    if kind == "algo":
        kw["amax_compute_algo"], err = (
            "mean",
            (ValueError, "amax_compute_algo='mean' is not supported"),
        )
    elif kind == "margin":
        kw["margin"], err = INF, (ValueError, "margin=inf must be finite")
    elif kind == "count":
        scales = scales[:2]
        err = (ValueError, "3 amax histories but 2 scales")
    elif kind == "fp8":
        fp8, err = torch.int8, (TypeError, "not an FP8 format")
    elif kind == "hist_dtype":
        hists[2] = hists[2].double()
        err = (TypeError, r"amax_histories\[2\] must be float32")
    elif kind == "scale_dtype":
        scales[1] = scales[1].half()
        err = (TypeError, r"scales\[1\] must be float32")
    elif kind == "hist_noncontig":
        hists[1] = torch.zeros(2, 4).t()
        err = (ValueError, r"amax_histories\[1\] must be contiguous")
    elif kind == "hist_1d":
        hists[2] = torch.zeros(2)
        err = (
            ValueError,
            r"amax_histories\[2\] has shape \(2,\); expected \[amax_history_len, num_slots\]",
        )
    elif kind == "hist_empty":
        hists[2] = torch.zeros(0, 2)
        err = (ValueError, "amax_history_len >= 1")
    elif kind == "scale_shape":
        scales[1] = torch.ones(3)
        err = (ValueError, r"scales\[1\] has shape \(3,\) but amax_histories\[1\] has 2 slots")
    elif kind == "buf_size":
        kw["amax_reduction_buffer"] = torch.zeros(6)
        err = (ValueError, "amax_reduction_buffer has 6 elements but the histories have 7 slots")
    elif kind == "buf_size_big":
        kw["amax_reduction_buffer"] = torch.zeros(8)
        err = (ValueError, "amax_reduction_buffer has 8 elements but the histories have 7 slots")
    elif kind == "buf_dtype":
        kw["amax_reduction_buffer"] = buf.double()
        err = (TypeError, "amax_reduction_buffer must be a contiguous float32")
    elif kind == "meta_hist":
        hists[2] = torch.empty(1, 2, device="meta")
        err = (ValueError, r"amax_histories\[2\] is a meta tensor")
    elif kind == "meta_buf":
        kw["amax_reduction_buffer"] = torch.empty(7, device="meta")
        err = (ValueError, "amax_reduction_buffer is a meta tensor")
    return hists, scales, fp8, kw, err


UPDATE_DEFECTS = ["algo", "margin", "count", "fp8", "hist_dtype", "scale_dtype", "hist_noncontig",
                  "hist_1d", "hist_empty", "scale_shape", "buf_size", "buf_size_big",
                  "buf_dtype", "meta_hist", "meta_buf"]  # fmt: skip


@pytest.mark.parametrize("kind", UPDATE_DEFECTS)
def test_delayed_scaling_update_refusals_change_nothing(kind):
    hists, scales, fp8, kw, (exc, msg) = _bad_update(kind)
    real = [t for t in hists + scales + [kw["amax_reduction_buffer"]] if not t.is_meta]
    snap = _clone(real)
    with pytest.raises(exc, match=msg):
        ext.delayed_scaling_update(hists, scales, fp8, **kw)
    assert all(torch.equal(uint8_view(a), uint8_view(b)) for a, b in zip(real, snap))
    with pytest.raises(exc, match=msg):
        ext.fused_amax_and_scale_update_after_reduction(
            kw["amax_reduction_buffer"], hists, scales, kw["amax_compute_algo"], fp8, kw["margin"]
        )
    assert all(torch.equal(uint8_view(a), uint8_view(b)) for a, b in zip(real, snap))


# ---------------------------------------------------------------- quantize / dequantize / amax refusals


def _bad_quantize(kind):
    x = sample()
    bufs = _filled_buffers(x)
    args = dict(input=x, scale=torch.tensor([2.0]), fp8_dtype=E4M3)
    extra = {}
    table = {
        "input_int": ("input", x.int(), TypeError, "quantize: input has dtype torch.int32; expected one of"),
        "input_f64": ("input", x.double(), TypeError, "input has dtype torch.float64"),
        "input_list": ("input", [1.0, 2.0], TypeError, "input must be a torch.Tensor, got list"),
        "fp8_f32": ("fp8_dtype", torch.float32, TypeError, "fp8_dtype=torch.float32 is not an FP8 format"),
        "fp8_enum": ("fp8_dtype", DType.kFloat16, TypeError, "is not an FP8 format"),
        "fp8_str": ("fp8_dtype", "e4m3", TypeError, "is not an FP8 format"),
        "scale_f64": ("scale", torch.tensor([2.0], dtype=torch.float64), TypeError, "scale must be float32, got torch.float64"),
        "scale_numel": ("scale", torch.tensor([2.0, 1.0]), ValueError, r"scale must hold exactly one element, got shape \(2,\)"),
        "amax_f16": ("amax", torch.zeros(1, dtype=torch.float16), TypeError, "amax must be float32"),
        "scale_inv_numel": ("scale_inv", torch.zeros(2), ValueError, "scale_inv must hold exactly one element"),
        "noop_f64": ("noop_flag", torch.zeros(1, dtype=torch.float64), TypeError, "noop_flag must be float32"),
        "out_shape": ("out", torch.empty(5, 3, 2, dtype=E4M3), ValueError, r"out has shape \(5, 3, 2\); expected \(2, 3, 5\)"),
        "out_dtype": ("out", torch.empty(2, 3, 5), TypeError, "out has dtype torch.float32"),
        "out_format": ("out", torch.empty(2, 3, 5, dtype=E5M2), TypeError, "out has dtype torch.float8_e5m2"),
        "out_noncontig": ("out", torch.empty(5, 3, 2, dtype=torch.uint8).permute(2, 1, 0), ValueError, "out must be contiguous"),
        "out_t_shape": ("out_transpose", torch.empty(2, 3, 5, dtype=E4M3), ValueError, r"out_transpose has shape \(2, 3, 5\); expected \(5, 2, 3\)"),
        "meta_input": ("input", torch.empty(2, 3, 5, device="meta"), ValueError, "input is a meta tensor"),
        "meta_scale": ("scale", torch.empty(1, device="meta"), ValueError, "scale is a meta tensor"),
        "meta_amax": ("amax", torch.empty(1, device="meta"), ValueError, "amax is a meta tensor"),
        "meta_noop": ("noop_flag", torch.empty(1, device="meta"), ValueError, "noop_flag is a meta tensor"),
        "meta_out_t": ("out_transpose", torch.empty(5, 2, 3, dtype=E4M3, device="meta"), ValueError, "out_transpose is a meta tensor"),
    }  # fmt: skip
    name, value, exc, msg = table[kind]
    kwargs = {**bufs, **args, **extra}
    kwargs[name] = value
    return bufs, kwargs, exc, msg


QUANTIZE_DEFECTS = ["input_int", "input_f64", "input_list", "fp8_f32", "fp8_enum", "fp8_str",
                    "scale_f64", "scale_numel", "amax_f16", "scale_inv_numel", "noop_f64", "out_shape",
                    "out_dtype", "out_format", "out_noncontig", "out_t_shape", "meta_input",
                    "meta_scale", "meta_amax", "meta_noop", "meta_out_t"]  # fmt: skip


@pytest.mark.parametrize("kind", QUANTIZE_DEFECTS)
def test_quantize_refusals_change_nothing(kind):
    bufs, kwargs, exc, msg = _bad_quantize(kind)
    snap = _snapshot(bufs)
    x = kwargs.pop("input")
    scale = kwargs.pop("scale")
    fp8 = kwargs.pop("fp8_dtype")
    with pytest.raises(exc, match=msg):
        ext.quantize(x, scale, fp8, **kwargs)
    assert _unchanged(bufs, snap)


def test_quantize_0d_input_with_transpose_refused():
    amax = torch.tensor([0.5])
    with pytest.raises(ValueError, match="0-d"):
        ext.quantize(torch.tensor(3.0), 1.0, E4M3, amax=amax, with_transpose=True)
    assert amax.item() == 0.5
    res = ext.quantize(torch.tensor(3.0), 1.0, E4M3, amax=amax)  # without a transpose it is fine
    assert res.data.shape == () and amax.item() == 3.0


@pytest.mark.parametrize(
    "kwargs,exc,msg",
    [
        (dict(data=torch.zeros(4)), TypeError, "dequantize: data has dtype torch.float32"),
        (dict(data=torch.zeros(4, dtype=torch.uint8)), TypeError, "data has dtype torch.uint8"),
        (dict(scale_inv=torch.ones(1, dtype=torch.float64)), TypeError, "scale_inv must be float32"),
        (dict(scale_inv=torch.ones(2)), ValueError, "scale_inv must hold exactly one element"),
        (dict(out_dtype=torch.float64), TypeError, "out_dtype=torch.float64 is not supported"),
        (dict(out=torch.full((5,), 7.0)), ValueError, r"out has shape \(5,\); expected \(4,\)"),
        (dict(out=torch.full((4,), 7.0, dtype=torch.float16)), TypeError, "out has dtype torch.float16"),
        (dict(data=torch.empty(4, dtype=E4M3, device="meta")), ValueError, "data is a meta tensor"),
        (dict(scale_inv=torch.empty(1, device="meta")), ValueError, "scale_inv is a meta tensor"),
    ],
)  # fmt: skip
def test_dequantize_refusals(kwargs, exc, msg):
    args = dict(data=torch.zeros(4, dtype=torch.uint8).view(E4M3), scale_inv=torch.ones(1),
                out_dtype=torch.float32, out=torch.full((4,), 7.0))  # fmt: skip
    args.update(kwargs)
    out = args["out"]
    snap = out.clone()
    with pytest.raises(exc, match=msg):
        ext.dequantize(args["data"], args["scale_inv"], args["out_dtype"], out=out)
    assert torch.equal(uint8_view(out), uint8_view(snap))


@pytest.mark.parametrize(
    "x,out,exc,msg",
    [
        (torch.zeros(3, dtype=torch.int64), None, TypeError, "compute_amax: input has dtype torch.int64"),
        (torch.zeros(3), torch.zeros(1, dtype=torch.float64), TypeError, "out must be float32"),
        (torch.zeros(3), torch.zeros(2), ValueError, "out must hold exactly one element"),
        (torch.empty(3, device="meta"), torch.zeros(1), ValueError, "input is a meta tensor"),
        (torch.zeros(3), torch.empty(1, device="meta"), ValueError, "out is a meta tensor"),
    ],
)  # fmt: skip
def test_compute_amax_refusals(x, out, exc, msg):
    snap = out.clone() if out is not None and not out.is_meta else None
    with pytest.raises(exc, match=msg):
        ext.compute_amax(x, out=out)
    if snap is not None:
        assert torch.equal(out, snap)


# ---------------------------------------------------------------- device seam


def test_check_same_device_message_names_both_devices():
    cpu, meta = torch.zeros(1), torch.empty(1, device="meta")
    with pytest.raises(
        ValueError, match=r"op: amax is on meta but input is on cpu; move amax to cpu"
    ):
        check_same_device("op", "input", cpu, amax=meta)
    with pytest.raises(ValueError, match=r"out is on cpu but data is on meta"):
        check_same_device("op", "data", meta, out=cpu)
    check_same_device(
        "op", "input", cpu, amax=torch.ones(2), scale=None
    )  # same device, None skipped


def test_reject_meta():
    with pytest.raises(ValueError, match="op: w is a meta tensor"):
        reject_meta("op", x=torch.zeros(1), w=torch.empty(1, device="meta"))
    reject_meta("op", x=torch.zeros(1), y=None)


# ---------------------------------------------------------------- constants


def test_dtype_values():
    expected = dict(kByte=0, kInt32=2, kFloat32=4, kFloat16=5, kBFloat16=6, kFloat8E4M3=7,
                    kFloat8E5M2=8, kFloat4E2M1=10)  # fmt: skip
    for name, value in expected.items():
        assert int(getattr(DType, name)) == value


def test_dtype_cast():
    assert DType.cast(DType.kFloat8E5M2) is DType.kFloat8E5M2
    assert DType.cast(7) is DType.kFloat8E4M3
    assert DType.cast(torch.float8_e5m2) is DType.kFloat8E5M2
    assert DType.cast(torch.bfloat16) is DType.kBFloat16

    class Wrapped:
        value = 4

    assert DType.cast(Wrapped()) is DType.kFloat32
    with pytest.raises(TypeError, match="torch.float64 has no transformer_engine DType"):
        DType.cast(torch.float64)
    with pytest.raises(ValueError):
        DType.cast(3)


def test_te_dtype_tables():
    assert TE_DType[torch.float8_e4m3fn] == DType.kFloat8E4M3
    assert TE_DType[torch.uint8] == DType.kByte
    assert all(TE_DType_To_Torch[v] == k for k, v in TE_DType.items())


@pytest.mark.parametrize(
    "arg,expected",
    [
        (E4M3, E4M3),
        (E5M2, E5M2),
        (DType.kFloat8E4M3, E4M3),
        (DType.kFloat8E5M2, E5M2),
        (7, E4M3),
        (8, E5M2),
    ],
)
def test_to_torch_fp8_dtype(arg, expected):
    assert to_torch_fp8_dtype(arg) is expected


@pytest.mark.parametrize(
    "arg", [torch.float32, torch.uint8, DType.kFloat32, DType.kFloat4E2M1, 99, "e4m3", None]
)
def test_to_torch_fp8_dtype_rejects(arg):
    with pytest.raises(TypeError, match="is not an FP8 format"):
        to_torch_fp8_dtype(arg)


def test_fp8_max():
    assert fp8_max(E4M3) == 448.0 and fp8_max(DType.kFloat8E4M3) == 448.0
    assert fp8_max(E5M2) == 57344.0 and fp8_max(8) == 57344.0
    with pytest.raises(TypeError):
        fp8_max(torch.float16)


# ---------------------------------------------------------------- native status


def test_native_status():
    st = transformer_engine.native_status()
    assert isinstance(st.available, bool)
    assert st is transformer_engine.native_status()  # loaded once
    if st.available:
        assert st.path and "native library loaded" in str(st)
    else:
        assert isinstance(st.reason, str) and st.reason.strip()
        assert str(st).startswith("native library not available:") and st.reason in str(st)


def test_python_dash_m_prints_status():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "transformer_engine"], cwd=REPO_ROOT, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "native library" in proc.stdout
    assert transformer_engine.__version__ in proc.stdout
