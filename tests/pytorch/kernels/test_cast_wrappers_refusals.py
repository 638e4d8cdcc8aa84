"""CPU tests of the validation in the cast kernel wrappers of
transformer_engine.pytorch.cpp_extensions: quantize, dequantize and compute_amax refuse bad
arguments with a message that names them and leave every buffer unchanged; and the device seam
(check_same_device, reject_meta).
"""

from __future__ import annotations

import pytest
import torch
from cast_wrappers_helpers import (
    E4M3,
    E5M2,
    _filled_buffers,
    _no_warnings_on_cpu,  # noqa: F401 (autouse fixture)
    _snapshot,
    _unchanged,
    sample,
)
from utils import uint8_view

from transformer_engine.pytorch import cpp_extensions as ext
from transformer_engine.pytorch.constants import DType
from transformer_engine.pytorch.device import check_same_device, reject_meta

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
