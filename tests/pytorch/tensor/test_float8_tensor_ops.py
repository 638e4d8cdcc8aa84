"""CPU tests of Float8Tensor as a torch.Tensor subclass: construction, repr, views, transposes,
slices, copies, device and dtype moves, in-place ops, and the high-precision fallback of
unsupported ops (with its warning). Bytes are compared with tests/pytorch/fp8_oracle.py."""

from __future__ import annotations

import warnings

import fp8_oracle as oracle
import pytest
import torch
from float8_tensor_helpers import E4M3, expected_bytes, fp8_param, sample

from transformer_engine.pytorch import quantized_tensor as qt_module
from transformer_engine.pytorch.constants import DType
from transformer_engine.pytorch.tensor import Float8CurrentScalingQuantizer, Float8Tensor

# ---------------------------------------------------------------------- the tensor itself


def test_constructor_validation():
    data = torch.zeros(4, 8, dtype=torch.uint8)
    ok = {"data": data, "fp8_scale_inv": torch.ones(1), "fp8_dtype": DType.kFloat8E4M3}
    t = Float8Tensor((4, 8), torch.float16, **ok)
    assert t.dtype == torch.float16 and t.device == data.device and t._quantizer is None
    assert Float8Tensor((4, 8), torch.float16, fake_dtype=torch.float16, **ok).dtype == t.dtype
    with pytest.raises(ValueError, match="shape"):
        Float8Tensor((8, 4), torch.float32, **ok)
    with pytest.raises(ValueError, match="data_transpose"):
        Float8Tensor((4, 8), torch.float32, data_transpose=data, **ok)
    with pytest.raises(TypeError, match="float32"):
        Float8Tensor((4, 8), torch.float32, **{**ok, "fp8_scale_inv": torch.ones(1).half()})
    with pytest.raises(TypeError, match="uint8"):
        Float8Tensor((4, 8), torch.float32, **{**ok, "data": torch.zeros(4, 8)})
    with pytest.raises(ValueError, match="contiguous"):
        Float8Tensor((4, 8), torch.float32, stride=(1, 4), **ok)
    with pytest.raises(ValueError, match="device"):
        Float8Tensor((4, 8), torch.float32, device="meta", **ok)
    with pytest.raises(ValueError, match="fake_dtype"):
        Float8Tensor((4, 8), torch.float32, fake_dtype=torch.float16, **ok)
    with pytest.raises(TypeError, match="nominal dtype"):
        Float8Tensor((4, 8), torch.int32, **ok)


def test_repr_names_dtype_fp8_dtype_scale_inv_device_and_values():
    y, _ = fp8_param()
    text = repr(y)
    for part in ("Float8Tensor", "kFloat8E4M3", "scale_inv=0.5", "torch.float32", "cpu"):
        assert part in text
    assert repr(y.dequantize())[:12] in text and str(y) == text


def test_detach_shares_buffers():
    y, _ = fp8_param()
    d = y.detach()
    assert isinstance(d, Float8Tensor) and d is not y and not d.requires_grad
    assert d._data is y._data and d._transpose is y._transpose and d._scale_inv is y._scale_inv
    assert d._quantizer is y._quantizer


def test_view_and_reshape():
    y, _ = fp8_param((4, 6, 16))
    v = y.view(24, 16)
    assert isinstance(v, Float8Tensor) and v.shape == (24, 16)
    assert v._data.data_ptr() == y._data.data_ptr()
    assert v._transpose is not None and v._transpose.data_ptr() == y._transpose.data_ptr()
    assert torch.equal(v._transpose, oracle.transpose_last_dim_first(v._data))
    assert torch.equal(v.dequantize(), y.dequantize().view(24, 16))
    r = y.reshape(-1, 8)  # last dim changes: the transpose no longer matches and is dropped
    assert isinstance(r, Float8Tensor) and r.shape == (48, 8) and r._transpose is None
    assert torch.equal(r.dequantize(), y.dequantize().reshape(-1, 8))
    f = y.flatten()
    assert isinstance(f, Float8Tensor) and f.shape == (384,)
    with torch.no_grad():
        a = torch.ops.aten.alias(y)
        u = torch.ops.aten._unsafe_view(y, [24, 16])
    assert isinstance(a, Float8Tensor) and a._data is y._data
    assert isinstance(u, Float8Tensor) and torch.equal(u.dequantize(), v.dequantize())
    assert y.contiguous() is y


def test_view_of_a_columnwise_only_tensor():
    q = Float8CurrentScalingQuantizer(E4M3, rowwise=False)
    with torch.no_grad():
        y = q(sample((4, 6, 16)))
    v = y.view(24, 16)
    assert isinstance(v, Float8Tensor) and v._data is None
    assert torch.equal(v.dequantize(), y.dequantize().view(24, 16))


@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("op", ["t", "transpose", "T"])
def test_transpose_of_2d(rowwise, columnwise, op):
    q = Float8CurrentScalingQuantizer(E4M3, rowwise=rowwise, columnwise=columnwise)
    x = sample((4, 16))
    with torch.no_grad():
        y = q(x)
        t = {"t": lambda a: a.t(), "transpose": lambda a: a.transpose(-1, 0), "T": lambda a: a.T}[
            op
        ](y)
    assert isinstance(t, Float8Tensor) and t.shape == (16, 4)
    assert torch.equal(t.dequantize(), y.dequantize().t())
    assert t._data is not None
    if rowwise:
        assert torch.equal(t._data, oracle.transpose_last_dim_first(y._data))
    else:
        assert t._data is y._transpose
    if t._transpose is not None:
        assert torch.equal(t._transpose, oracle.transpose_last_dim_first(t._data))
    assert torch.equal(t.t().dequantize(), y.dequantize())


def test_transpose_of_3d_falls_back_to_high_precision():
    y, _ = fp8_param((2, 4, 16))
    qt_module._warned_ops.discard("aten.transpose.int")
    with pytest.warns(UserWarning, match="aten.transpose.int"):
        t = y.transpose(0, 1)
    assert type(t) is torch.Tensor and torch.equal(t, y.dequantize().transpose(0, 1))


def test_clone_has_independent_buffers():
    y, _ = fp8_param()
    c = y.clone()
    assert isinstance(c, Float8Tensor)
    for a, b in ((c._data, y._data), (c._transpose, y._transpose), (c._scale_inv, y._scale_inv)):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert c._quantizer is y._quantizer


def test_slice_and_select_along_dim_0():
    y, _ = fp8_param((6, 16))
    s = y[1:4]
    assert isinstance(s, Float8Tensor) and s.shape == (3, 16)
    assert s._data.data_ptr() == y._data[1].data_ptr() and s._scale_inv is y._scale_inv
    assert torch.equal(s.dequantize(), y.dequantize()[1:4])
    r = y[2]
    assert isinstance(r, Float8Tensor) and r.shape == (16,)
    assert torch.equal(r.dequantize(), y.dequantize()[2])
    n = y.narrow(0, 2, 3)
    assert isinstance(n, Float8Tensor) and torch.equal(n.dequantize(), y.dequantize()[2:5])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        col = y[:, 3]  # other dims run in high precision
    assert type(col) is torch.Tensor and torch.equal(col, y.dequantize()[:, 3])


def test_writing_into_a_slice_keeps_the_shared_scale():
    y, state = fp8_param((6, 16))
    before = y._data.clone()
    state.scale[1] = 16.0  # the quantizer's scale moved on since y was cast with 2.0
    new_rows = sample((2, 16), seed=9)
    y[1:3] = new_rows  # copy_ into a slice
    assert y._scale_inv.item() == 0.5  # the shared scale of the whole buffer is kept
    assert torch.equal(y._data[1:3], expected_bytes(new_rows, 2.0))
    assert torch.equal(y._data[3:], before[3:]) and torch.equal(y._data[:1], before[:1])


def test_new_empty_empty_like_new_zeros():
    y, _ = fp8_param((4, 16))
    e = torch.empty_like(y)
    assert isinstance(e, Float8Tensor) and e.shape == y.shape and e._transpose is not None
    assert e._data.data_ptr() != y._data.data_ptr() and e._quantizer is y._quantizer
    n = y.new_empty((2, 8))
    assert isinstance(n, Float8Tensor) and n.shape == (2, 8) and n._transpose.shape == (8, 2)
    z = y.new_zeros((3, 16))
    assert isinstance(z, Float8Tensor) and torch.count_nonzero(z.dequantize()) == 0
    assert z._scale_inv.item() == y._scale_inv.item()
    m = torch.empty_like(y, device="meta")
    assert isinstance(m, Float8Tensor) and m.is_meta


def test_copy_between_float8_tensors_is_a_raw_byte_copy():
    a, _ = fp8_param(seed=1, scale=2.0)
    b, _ = fp8_param(seed=2, scale=8.0)
    data_ptr = a._data.data_ptr()
    a.copy_(b)
    assert torch.equal(a._data, b._data) and torch.equal(a._transpose, b._transpose)
    assert a._scale_inv.item() == b._scale_inv.item() == 0.125
    assert a._data.data_ptr() == data_ptr


def test_copy_from_a_plain_tensor_requantizes_with_the_destination_quantizer():
    y, state = fp8_param()
    state.scale[1] = 4.0
    state.amax_history.zero_()
    x = sample(seed=5)
    y.copy_(x)
    assert torch.equal(y._data, expected_bytes(x, 4.0))
    assert torch.equal(y._transpose, oracle.transpose_last_dim_first(y._data))
    assert y._scale_inv.item() == 0.25
    assert state.amax_history[0, 1] == oracle.amax(x)[0]
    y.copy_(torch.zeros(8))  # broadcasts like torch.Tensor.copy_
    assert torch.count_nonzero(y._data) == 0
    plain = torch.empty(4, 8, dtype=torch.float16)
    plain.copy_(y)
    assert torch.equal(plain, y.dequantize(dtype=torch.float16))


def test_quantize_into_out_and_update_quantized_errors():
    y, state = fp8_param()
    q = state.quantizer()
    x = sample(seed=3)
    assert q.quantize(x, out=y) is y and torch.equal(y._data, expected_bytes(x, 2.0))
    before = y._data.clone()
    with pytest.raises(ValueError, match="shape"):
        q.update_quantized(sample((2, 2)), y)
    with pytest.raises(TypeError, match="Float8Tensor"):
        q.update_quantized(x, torch.empty(4, 8))
    assert torch.equal(y._data, before)
    y.quantize_(x * 10, noop_flag=torch.ones(1))  # noop: nothing written
    assert torch.equal(y._data, before)


def test_quantize_without_a_quantizer_keeps_the_scale():
    y, _ = fp8_param()
    bare = Float8Tensor(y.shape, y.dtype, data=y._data.clone(), fp8_scale_inv=torch.tensor([0.25]),
                        fp8_dtype=y._fp8_dtype)  # fmt: skip
    x = sample(seed=4)
    bare.quantize_(x)
    assert torch.equal(bare._data, expected_bytes(x, 4.0)) and bare._scale_inv.item() == 0.25


def test_device_moves_keep_the_subclass():
    y, _ = fp8_param()
    assert y.cpu() is y and y.to("cpu") is y
    c = y.to("cpu", copy=True)
    assert isinstance(c, Float8Tensor) and c._data.data_ptr() != y._data.data_ptr()
    assert torch.equal(c._data, y._data) and torch.equal(c._scale_inv, y._scale_inv)
    # meta holds no data: the move gives a meta Float8Tensor; moving back out is refused.
    m = y.to("meta")
    assert isinstance(m, Float8Tensor) and m.is_meta
    assert m._data.is_meta and m._transpose.is_meta and m._scale_inv.is_meta
    with pytest.raises(ValueError, match="meta holds no data"):
        m.to("cpu")


def test_dtype_conversions_dequantize_without_warning():
    y, _ = fp8_param()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype, out in (
            (torch.float32, y.float()),
            (torch.float16, y.half()),
            (torch.bfloat16, y.bfloat16()),
            (torch.bfloat16, y.to(torch.bfloat16)),
            (torch.float64, y.double()),
        ):
            assert type(out) is torch.Tensor and out.dtype == dtype
            assert torch.equal(out, y.dequantize().to(dtype))
        assert y.to_dtype(torch.float16).dtype == torch.float16


def test_inplace_ops_requantize_into_the_same_tensor():
    q = Float8CurrentScalingQuantizer(E4M3)
    with torch.no_grad():
        y = q(sample())
    data = y._data
    expected_values = y.dequantize() * 3
    out = y.mul_(3)
    assert out is y and isinstance(y, Float8Tensor) and y._data is data
    scale = oracle.scale_from_amax(oracle.amax(expected_values), E4M3)
    assert torch.equal(y._data, oracle.cast_bytes(expected_values, scale, E4M3))
    assert torch.equal(y._transpose, oracle.transpose_last_dim_first(y._data))
    doubled = y.dequantize() * 2
    y.add_(y)  # aliasing of the argument with itself is kept
    assert torch.equal(y.dequantize(), q(doubled).dequantize())
    y.zero_()
    assert torch.count_nonzero(y._data) == 0


def test_unknown_ops_dequantize_and_warn_once_per_op():
    y, _ = fp8_param()
    qt_module._warned_ops.discard("aten.sin.default")
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        out = torch.sin(y)
    assert type(out) is torch.Tensor and torch.equal(out, torch.sin(y.dequantize()))
    messages = [str(w.message) for w in first]
    assert len(messages) == 1
    assert "aten.sin.default" in messages[0] and "high precision" in messages[0]
    with warnings.catch_warnings(record=True) as second:
        warnings.simplefilter("always")
        torch.sin(y)
    assert second == []


def test_split_unsqueeze_squeeze_and_is_pinned():
    y, _ = fp8_param((6, 16))
    parts = y.split(2)
    assert len(parts) == 3 and all(isinstance(p, Float8Tensor) for p in parts)
    assert torch.equal(torch.cat([p.dequantize() for p in parts]), y.dequantize())
    assert [p.shape[0] for p in y.split([1, 5])] == [1, 5]
    u = y.unsqueeze(0)
    assert isinstance(u, Float8Tensor) and u.shape == (1, 6, 16) and u._transpose is not None
    assert isinstance(u.squeeze(0), Float8Tensor) and u.squeeze().shape == (6, 16)
    assert y.is_pinned() is False and y.numel() == 96


def test_fallback_warning_points_at_the_caller():
    y, _ = fp8_param()
    qt_module._warned_ops.discard("aten.cos.default")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cos(y)
    assert len(caught) == 1 and caught[0].filename == __file__
