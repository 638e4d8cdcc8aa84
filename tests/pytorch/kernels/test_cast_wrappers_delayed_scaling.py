"""CPU tests of the delayed-scaling update kernel wrapper
(cpp_extensions.delayed_scaling_update): the amax history roll and the new scales bit for bit
for each format, algorithm, margin and reduction buffer, in place; an empty update is a no-op;
and every refusal changes nothing.

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
    INF,
    NAN,
    _no_warnings_on_cpu,  # noqa: F401 (autouse fixture)
)
from utils import float32_bits, uint8_view

from transformer_engine.pytorch import cpp_extensions as ext
from transformer_engine.pytorch.constants import DType, to_torch_fp8_dtype

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
