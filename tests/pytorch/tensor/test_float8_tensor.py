"""CPU tests of the FP8 quantizers, Float8TensorStorage and Float8Tensor.

Casts are compared bit for bit with tests/pytorch/fp8_oracle.py, which shares no code with
transformer_engine.pytorch.reference (the CPU path runs the reference through the kernel
wrappers, so comparing with it would compare the reference with itself). Delayed-scaling
quantizers are built the way the recipe state builds them: ``scale`` is a 0-d
view into a scale vector and ``amax`` a one-element view into row 0 of an amax
history, and the tests check that casts write into that storage.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import warnings

import fp8_oracle as oracle
import pytest
import torch
from utils import float32_bits, uint8_view

from transformer_engine.pytorch import quantized_tensor as qt_module
from transformer_engine.pytorch.constants import DType
from transformer_engine.pytorch.tensor import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    Float8TensorStorage,
    QuantizedTensor,
    QuantizedTensorStorage,
    Quantizer,
    _float8_quantize_into,
)
from transformer_engine.pytorch.tensor.float8_tensor import _make_float8_tensor_in_reduce_ex
from transformer_engine.pytorch.tensor.storage import float8_tensor_storage

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
HP = (torch.float32, torch.float16, torch.bfloat16)


def sample(shape=(4, 8), dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


class DelayedState:
    """Scale vector and amax history shaped like the recipe state's (N slots, L rows)."""

    def __init__(self, slots=3, history=4, scale=2.0):
        self.scale = torch.full((slots,), scale)
        self.amax_history = torch.zeros(history, slots)

    def quantizer(self, i=1, fp8=E4M3, **kw) -> Float8Quantizer:
        return Float8Quantizer(
            self.scale[i], self.amax_history[0][i].reshape((1,)), fp8, **kw
        )  # fmt: skip


def expected_bytes(x, scale, fp8=E4M3):
    return oracle.cast_bytes(x, torch.as_tensor(scale, dtype=torch.float32), fp8)


def fp8_param(shape=(4, 8), seed=0, scale=2.0):
    state = DelayedState(scale=scale)
    with torch.no_grad():
        t = state.quantizer()(sample(shape, seed=seed))
    return t, state


# ---------------------------------------------------------------------- delayed scaling


@pytest.mark.parametrize("fp8", [E4M3, E5M2, DType.kFloat8E4M3, DType.kFloat8E5M2])
@pytest.mark.parametrize("in_dtype", HP)
def test_delayed_quantize_matches_the_oracle_bitwise(fp8, in_dtype):
    state = DelayedState(scale=0.75)
    q = state.quantizer(fp8=fp8)
    x = sample((3, 5, 16), in_dtype)
    with torch.no_grad():
        y = q(x)
    torch_fp8 = E4M3 if fp8 in (E4M3, DType.kFloat8E4M3) else E5M2
    ref = oracle.cast_bytes(x, 0.75, torch_fp8)
    assert isinstance(y, Float8Tensor) and isinstance(y, QuantizedTensor)
    assert y.dtype == in_dtype and y.shape == x.shape and y.device == x.device
    assert y._data.dtype == torch.uint8 and torch.equal(y._data, uint8_view(ref))
    assert y._transpose.dtype == torch.uint8
    assert torch.equal(y._transpose, oracle.transpose_last_dim_first(ref))
    assert y._transpose.shape == (16, 3, 5) and not y._transpose_invalid
    assert torch.equal(float32_bits(y._scale_inv), float32_bits(oracle.reciprocal(0.75)))
    assert y._scale_inv.shape == (1,) and y._scale_inv.dtype == torch.float32
    assert y._fp8_dtype == DType.cast(torch_fp8) and isinstance(y._fp8_dtype, DType)
    assert y._dtype == in_dtype
    assert torch.equal(y.dequantize(), oracle.dequantize(ref, y._scale_inv, in_dtype, torch_fp8))


def test_delayed_amax_accumulates_into_the_recipe_state_views():
    state = DelayedState()
    q = state.quantizer(i=1)
    assert q.scale.data_ptr() == state.scale[1].data_ptr()
    assert q.amax.data_ptr() == state.amax_history[0][1].data_ptr()
    x1, x2 = sample(seed=1, scale=5.0), sample(seed=2, scale=0.5)
    with torch.no_grad():
        q(x1)
    assert state.amax_history[0, 1] == oracle.amax(x1)[0]
    others = state.amax_history.clone()
    others[0, 1] = 0
    assert torch.count_nonzero(others) == 0
    with torch.no_grad():
        q(x2)  # smaller amax: the maximum is kept (accumulation, not overwrite)
    assert state.amax_history[0, 1] == oracle.amax(x1)[0]
    x3 = sample(seed=3, scale=50.0)
    with torch.no_grad():
        q(x3)
    assert state.amax_history[0, 1] == oracle.amax(x3)[0]
    # A scale update in the recipe state is seen by the next cast (no copy was taken).
    state.scale[1] = 4.0
    with torch.no_grad():
        y = q(x1)
    assert y._scale_inv.item() == 0.25
    assert torch.equal(y._data, expected_bytes(x1, 4.0))
    # copy() and the tensor's own quantizer share scale and amax.
    c = q.copy()
    assert c.scale is q.scale and c.amax is q.amax
    assert y._quantizer is not q and y._quantizer.amax is q.amax


def test_delayed_constructor_validation():
    with pytest.raises(ValueError, match="one-element float32"):
        Float8Quantizer(torch.ones(2), torch.zeros(1), E4M3)
    with pytest.raises(ValueError, match="one-element float32"):
        Float8Quantizer(torch.ones(1), torch.zeros(1, dtype=torch.float16), E4M3)
    with pytest.raises(TypeError, match="fp8_dtype"):
        Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float16)
    with pytest.raises(ValueError, match=r"meta.*cpu|cpu.*meta"):
        Float8Quantizer(torch.ones(1), torch.zeros(1, device="meta"), E4M3)


def test_delayed_refuses_state_on_another_device_and_changes_nothing():
    q = Float8Quantizer(torch.ones((), device="meta"), torch.zeros(1, device="meta"), E4M3)
    with pytest.raises(ValueError, match="scale is a meta tensor"):
        with torch.no_grad():
            q(sample())
    y, _ = fp8_param()
    before = (y._data.clone(), y._transpose.clone(), y._scale_inv.clone())
    with pytest.raises(ValueError, match="meta"):
        q.update_quantized(sample(seed=4), y)
    for a, b in zip((y._data, y._transpose, y._scale_inv), before):
        assert torch.equal(a, b)


def test_delayed_calibrate_overwrites_amax_without_casting():
    state = DelayedState()
    state.amax_history[0, 1] = 100.0
    q = state.quantizer()
    x = sample(scale=0.1)
    q.calibrate(x)
    assert state.amax_history[0, 1] == oracle.amax(x)[0]


def test_create_tensor_from_data():
    state = DelayedState(scale=4.0)
    q = state.quantizer()
    raw = expected_bytes(sample(), 4.0)
    t = q.create_tensor_from_data(raw.view(E4M3), fake_dtype=torch.bfloat16)
    assert isinstance(t, Float8Tensor) and t.dtype == torch.bfloat16
    assert torch.equal(t._data, raw) and t._scale_inv.item() == 0.25
    assert torch.equal(t._transpose, oracle.transpose_last_dim_first(uint8_view(raw)))
    s = q.create_tensor_from_data(raw, internal=True)
    assert type(s) is Float8TensorStorage and q.internal is False
    with pytest.raises(TypeError, match="uint8"):
        q.create_tensor_from_data(torch.zeros(2, 2))


# ---------------------------------------------------------------------- current scaling


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("in_dtype", HP)
@pytest.mark.parametrize("epsilon,pow2", [(0.0, False), (0.0, True), (1e3, False), (1e3, True)])
def test_current_scaling_matches_the_oracle_bitwise(fp8, in_dtype, epsilon, pow2):
    q = Float8CurrentScalingQuantizer(fp8, amax_epsilon=epsilon, force_pow_2_scales=pow2)
    x = sample((6, 16), in_dtype, scale=7.0)
    with torch.no_grad():
        y = q(x)
    scale = oracle.scale_from_amax(oracle.amax(x), fp8, epsilon, pow2)
    ref = oracle.cast_bytes(x, scale, fp8)
    assert torch.equal(y._data, uint8_view(ref))
    assert torch.equal(y._transpose, oracle.transpose_last_dim_first(ref))
    assert torch.equal(float32_bits(y._scale_inv), float32_bits(oracle.reciprocal(scale)))
    if epsilon:
        assert y._scale_inv.item() > oracle.amax(x).item() / (448 if fp8 is E4M3 else 57344)
    if pow2:
        assert math.log2(y._scale_inv.item()).is_integer()


def test_current_scaling_of_zeros_uses_scale_one():
    q = Float8CurrentScalingQuantizer(E4M3)
    with torch.no_grad():
        y = q(torch.zeros(4, 4))
    assert y._scale_inv.item() == 1.0 and torch.count_nonzero(y._data) == 0


def test_current_scaling_has_no_side_effects_and_warns_on_deprecated_args():
    scale, amax = torch.full((1,), 3.0), torch.full((1,), 7.0)
    with pytest.warns(DeprecationWarning, match="scale"):
        q = Float8CurrentScalingQuantizer(E4M3, "cuda:5", scale=scale)
    with pytest.warns(DeprecationWarning, match="amax"):
        Float8CurrentScalingQuantizer(E4M3, amax=amax)
    with pytest.warns(DeprecationWarning, match="use_existing_amax"):
        Float8CurrentScalingQuantizer(E4M3, use_existing_amax=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Float8CurrentScalingQuantizer(E4M3, None)
    x = sample()
    with torch.no_grad():
        y = q(x)  # the (ignored) device argument does not matter: the input's device is used
    assert y.device == x.device
    assert scale.item() == 3.0 and amax.item() == 7.0


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_current_scaling_rejects_bad_epsilon(bad):
    with pytest.raises(ValueError, match="amax_epsilon"):
        Float8CurrentScalingQuantizer(E4M3, amax_epsilon=bad)


def test_current_scaling_amax_reduction_is_a_max_all_reduce_over_the_group(monkeypatch):
    calls = []
    group = object()

    def fake_all_reduce(tensor, op=None, group=None, async_op=False):
        calls.append((tensor.clone(), op, group))
        tensor.fill_(1000.0)

    monkeypatch.setattr(torch.distributed, "all_reduce", fake_all_reduce)
    q = Float8CurrentScalingQuantizer(
        E4M3, with_amax_reduction=True, amax_reduction_group=group
    )  # fmt: skip
    x = sample(scale=1.0)
    with torch.no_grad():
        y = q(x)
    assert len(calls) == 1
    local_amax, op, used_group = calls[0]
    assert op == torch.distributed.ReduceOp.MAX and used_group is group
    assert torch.equal(local_amax, oracle.amax(x))
    scale = oracle.scale_from_amax(torch.tensor([1000.0]), E4M3)
    assert torch.equal(float32_bits(y._scale_inv), float32_bits(oracle.reciprocal(scale)))
    assert torch.equal(y._data, oracle.cast_bytes(x, scale, E4M3))
    # The produced tensor re-quantizes locally, and pickling drops the group.
    assert y._quantizer.with_amax_reduction is False and y._quantizer.amax_reduction_group is None
    assert pickle.loads(pickle.dumps(q)).amax_reduction_group is None
    assert q.amax_reduction_group is group


def test_compatible_recipes():
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

    assert DelayedState().quantizer()._get_compatible_recipe() is DelayedScaling
    assert Float8CurrentScalingQuantizer(E4M3)._get_compatible_recipe() is Float8CurrentScaling
    assert Float8CurrentScalingQuantizer(E4M3).is_requantization_safe()
    assert DelayedState().quantizer().supports_only_rowwise_all_gather()


# ---------------------------------------------------------------------- usages


@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (True, True)])
def test_quantizer_usages_decide_the_layouts(rowwise, columnwise):
    q = Float8CurrentScalingQuantizer(E4M3, rowwise=rowwise, columnwise=columnwise)
    assert q.get_usages() == {"rowwise": rowwise, "columnwise": columnwise}
    x = sample((4, 16))
    with torch.no_grad():
        y = q(x)
    assert (y._data is not None) == rowwise
    assert (y._transpose is not None) == columnwise
    assert y._transpose_invalid == (not columnwise)
    assert y.get_usages() == {"rowwise": rowwise, "columnwise": columnwise}
    full = Float8CurrentScalingQuantizer(E4M3)
    with torch.no_grad():
        ref = full(x)
    assert torch.equal(y.dequantize(), ref.dequantize())


def test_quantizer_without_usages_is_refused():
    q = Float8CurrentScalingQuantizer(E4M3)
    q.set_usage(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="set_usage"):
        with torch.no_grad():
            q(sample())
    q.set_usage(rowwise=True)
    assert q.get_usages() == {"rowwise": True, "columnwise": False}


def test_update_usage_adds_and_removes_the_transpose():
    q = Float8CurrentScalingQuantizer(E4M3, columnwise=False)
    with torch.no_grad():
        y = q(sample((4, 16)))
    assert y._transpose is None
    y.update_usage(columnwise_usage=True)
    assert torch.equal(y._transpose, oracle.transpose_last_dim_first(y._data))
    assert y.get_usages() == {"rowwise": True, "columnwise": True}
    y.update_usage(rowwise_usage=False)
    assert y._data is None and y._transpose is not None
    assert y.get_data_tensors() == (None, y._transpose)
    # Data is never regenerated from the transpose, and a refused call changes nothing.
    kept = y._transpose
    with pytest.raises(RuntimeError, match="transpose"):
        y.update_usage(rowwise_usage=True)
    assert y._data is None and y._transpose is kept
    with pytest.raises(ValueError, match="both be False"):
        y.update_usage(columnwise_usage=False)
    assert y._transpose is kept
    y.update_usage(rowwise_usage=None, columnwise_usage=None)
    assert y._transpose is kept


def test_storage_api_for_internal_quantizers():
    q = Float8CurrentScalingQuantizer(E5M2)
    q.internal = True
    x = sample((3, 16))
    s = q(x)  # internal: a plain storage, even in grad mode
    assert type(s) is Float8TensorStorage and isinstance(s, QuantizedTensorStorage)
    assert not isinstance(s, torch.Tensor)
    assert s.size() == (3, 16) and s.size(1) == 16 and s.shape == (3, 16)
    assert s.device == torch.device("cpu")
    data, transpose = s.get_data_tensors()
    assert s.get_data_tensors(columnwise_data=False) is data
    assert s.get_data_tensors(rowwise_data=False) is transpose
    meta = s.get_metadata()
    assert meta["data"] is data and meta["fp8_dtype"] == DType.kFloat8E5M2
    assert torch.equal(Float8TensorStorage(**meta).dequantize(), s.dequantize())
    scale_inv = s._scale_inv
    tensors, obj = s.prepare_for_saving()
    assert obj is s and tensors[0] is data and tensors[1] is transpose and tensors[2] is scale_inv
    assert s._data is None and s._transpose is None and s._scale_inv is None
    assert s.restore_from_saved([*tensors, "rest"]) == ["rest"]
    assert s._data is data and s._scale_inv is scale_inv
    view = s.view((48,))
    assert view.size() == (48,) and view._transpose is None
    assert torch.equal(view.dequantize(), s.dequantize().view(48))
    assert "Float8TensorStorage" in repr(s)
    s.clear()
    assert s._data is None and s._transpose is None
    with pytest.raises(RuntimeError, match="no buffers"):
        s.size()


def test_prepare_for_saving_helpers_round_trip_storages_and_tensors():
    q = Float8CurrentScalingQuantizer(E4M3)
    q.internal = True
    s, plain = q(sample()), torch.ones(2)
    tensors, objects = qt_module.prepare_for_saving(s, plain)
    assert len(tensors) == 4 and tensors[3] is plain
    out = qt_module.restore_from_saved(objects, tensors)
    assert out[0] is s and out[1] is plain and s._data is tensors[0]


# ---------------------------------------------------------------------- make_empty


def test_make_empty():
    state = DelayedState()
    q = state.quantizer()
    e = q.make_empty((2, 16), dtype=torch.bfloat16, requires_grad=True)
    assert isinstance(e, Float8Tensor) and e.device == state.scale.device
    assert e.dtype == torch.bfloat16 and e.requires_grad and e.is_leaf
    assert e._data.shape == (2, 16) and e._transpose.shape == (16, 2)
    assert e._scale_inv.item() == 1.0
    m = q.make_empty((2, 16), device="meta")
    assert m.is_meta and m._data.is_meta
    cs = Float8CurrentScalingQuantizer(E4M3, columnwise=False)
    with pytest.raises(ValueError, match="device=None"):
        cs.make_empty((2, 16))
    e = cs.make_empty((2, 16), device="cpu")
    assert e._transpose is None
    cs.internal = True
    assert type(cs.make_empty((2, 16), device="cpu")) is Float8TensorStorage
    with pytest.raises(TypeError, match="high-precision"):
        cs.make_empty((2, 16), dtype=torch.int32, device="cpu")


def test_quantizing_a_meta_tensor_gives_a_meta_float8_tensor_without_amax():
    state = DelayedState()
    with torch.no_grad():
        y = state.quantizer()(torch.empty(4, 8, device="meta"))
    assert isinstance(y, Float8Tensor) and y.is_meta
    assert torch.count_nonzero(state.amax_history) == 0
    assert "meta" in repr(y)


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


def test_optimizer_step_on_an_fp8_parameter():
    y, state = fp8_param()
    p = torch.nn.Parameter(y)
    assert isinstance(p, Float8Tensor) and isinstance(p, torch.nn.Parameter)
    opt = torch.optim.SGD([p], lr=0.5)
    p.grad = sample(seed=7)
    state.amax_history.zero_()
    expected = p.dequantize().detach() - 0.5 * p.grad
    data_ptr = p._data.data_ptr()
    opt.step()
    assert isinstance(p, Float8Tensor) and p._data.data_ptr() == data_ptr
    assert torch.equal(p._data, expected_bytes(expected, 2.0))
    assert torch.equal(p._transpose, oracle.transpose_last_dim_first(p._data))
    assert state.amax_history[0, 1] == oracle.amax(expected)[0]


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


def test_save_and_load_round_trip_bitwise():
    y, _ = fp8_param((4, 16))
    cols = Float8CurrentScalingQuantizer(E5M2, rowwise=False)
    with torch.no_grad():
        c = cols(sample((4, 16), torch.bfloat16))
    for weights_only in (False, True):
        buf = io.BytesIO()
        torch.save({"y": y, "c": c, "p": torch.nn.Parameter(y)}, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=weights_only)
        for key, src in (("y", y), ("c", c), ("p", y)):
            out = loaded[key]
            assert isinstance(out, Float8Tensor) and out.dtype == src.dtype
            assert out._fp8_dtype == src._fp8_dtype and out.shape == src.shape
            for a, b in ((out._data, src._data), (out._transpose, src._transpose)):
                assert (a is None and b is None) or torch.equal(a, b)
            assert torch.equal(float32_bits(out._scale_inv), float32_bits(src._scale_inv))
            assert out._quantizer is None
    assert _make_float8_tensor_in_reduce_ex in torch.serialization.get_safe_globals()


def test_deepcopy_and_data_setter():
    y, _ = fp8_param()
    p = torch.nn.Parameter(y)
    d = copy.deepcopy(p)
    assert isinstance(d, Float8Tensor) and isinstance(d, torch.nn.Parameter) and d.requires_grad
    assert torch.equal(d._data, p._data) and d._data.data_ptr() != p._data.data_ptr()
    other, _ = fp8_param(seed=3)
    p.data = other
    assert p._data is other._data and p._scale_inv is other._scale_inv
    x = sample(seed=6)
    p.data = x
    assert torch.equal(p._data, expected_bytes(x, 2.0))
    with pytest.raises(ValueError, match="shape"):
        p.data = torch.zeros(3)


def test_module_moves_and_materialization():
    y, _ = fp8_param()
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(y)
    m.to("meta")
    assert isinstance(m.w, Float8Tensor) and m.w.is_meta and m.w._data.is_meta
    m.to_empty(device="cpu")
    assert isinstance(m.w, Float8Tensor) and m.w.device.type == "cpu"
    assert isinstance(m.w, torch.nn.Parameter)
    with torch.no_grad():
        m.w.copy_(sample())
    m.half()
    assert isinstance(m.w, Float8Tensor) and m.w.dtype == torch.float16


# ---------------------------------------------------------------------- autograd


def test_quantize_is_straight_through():
    q = Float8CurrentScalingQuantizer(E4M3)
    x = sample().requires_grad_()
    y = q(x)
    assert y.requires_grad and y.grad_fn is not None
    g = sample(seed=11)
    y.dequantize().backward(g)
    assert torch.equal(x.grad, g)


def test_quantize_with_another_nominal_dtype():
    q = Float8CurrentScalingQuantizer(E4M3)
    x = sample().requires_grad_()
    y = q(x, dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.dequantize().dtype == torch.bfloat16
    y.dequantize().float().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, torch.ones_like(x))
    with pytest.raises(TypeError, match="dtype"):
        q(x, dtype=torch.int8)


def test_dequantize_and_fallback_ops_are_differentiable():
    y, _ = fp8_param()
    p = torch.nn.Parameter(y)
    p.dequantize(dtype=torch.bfloat16).float().sum().backward()
    assert type(p.grad) is torch.Tensor and p.grad.dtype == torch.float32
    assert torch.equal(p.grad, torch.ones(4, 8))
    p.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (p * 3).sum().backward()
    assert torch.equal(p.grad, torch.full((4, 8), 3.0))
    p.grad = None
    p.view(32).dequantize().sum().backward()
    assert torch.equal(p.grad, torch.ones(4, 8))


def test_quantizer_is_abstract_and_validates_input():
    with pytest.raises(TypeError):
        Quantizer(rowwise=True, columnwise=True)
    q = Float8CurrentScalingQuantizer(E4M3)
    with pytest.raises(TypeError, match="torch.Tensor"):
        q.quantize([1.0, 2.0])
    with pytest.raises(TypeError, match="dtype"):
        with torch.no_grad():
            q(torch.ones(4, dtype=torch.float64))
    assert q.is_quantizable(torch.ones(2)) and not q.is_quantizable(
        torch.ones(2, dtype=torch.int32)
    )
    c = q.copy()
    c.set_usage(columnwise=False)
    assert q.columnwise_usage and not c.columnwise_usage


def test_non_tn_devices_never_hold_a_transpose(monkeypatch):
    # Data-center Blackwell takes any GEMM layout: _data serves both usages.
    for module in (_float8_quantize_into, float8_tensor_storage):
        monkeypatch.setattr(module, "is_non_tn_fp8_gemm_supported", lambda device: True)
    q = Float8CurrentScalingQuantizer(E4M3, rowwise=False, columnwise=True)
    with torch.no_grad():
        y = q(sample((4, 16)))
    assert y._data is not None and y._transpose is None
    assert y.get_usages() == {"rowwise": True, "columnwise": True}
    y.update_usage(rowwise_usage=False, columnwise_usage=True)
    assert y._data is not None and y._transpose is None


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


# ------------------------------------------------------------------------------------------
# quantize_with_dbias_impl: the linear core's grad-output cast that also yields the bias gradient


@pytest.mark.parametrize("kind", ["delayed", "current"])
@pytest.mark.parametrize("columnwise", [True, False])
@pytest.mark.parametrize("dtype", HP)
def test_quantize_with_dbias_is_quantize_plus_the_column_sum(kind, columnwise, dtype):
    x = sample((3, 40, 32), dtype=dtype, seed=4)

    def make():
        if kind == "delayed":
            return DelayedState().quantizer(fp8=E5M2)
        return Float8CurrentScalingQuantizer(E5M2)

    fused_q, plain_q = make(), make()
    for q in (fused_q, plain_q):
        q.set_usage(rowwise=True, columnwise=columnwise)
    fused, dbias = fused_q.quantize_with_dbias_impl(x)
    plain = plain_q.quantize_impl(x)
    assert torch.equal(uint8_view(fused._data), uint8_view(plain._data))
    if columnwise:
        assert torch.equal(uint8_view(fused._transpose), uint8_view(plain._transpose))
    assert torch.equal(fused._scale_inv, plain._scale_inv)
    assert dbias.dtype == dtype and dbias.shape == (32,)
    # Accumulated in float32, rounded once to dtype: within the float32 summation bound
    # ((rows - 1) * 2**-24 * sum |x|) plus one rounding of dtype of the float64 sum.
    exact = oracle.column_sum(x.double())
    rows = x.numel() // x.shape[-1]
    bound = (rows - 1) * 2.0**-24 * oracle.column_sum(x.double().abs())
    bound += torch.finfo(dtype).eps * exact.abs()
    assert ((dbias.double() - exact).abs() <= bound).all()


def test_quantize_with_dbias_of_an_empty_tensor_gives_zeros():
    q = Float8CurrentScalingQuantizer(E4M3)
    q.set_usage(rowwise=True, columnwise=True)
    _, dbias = q.quantize_with_dbias_impl(torch.empty(0, 16))
    assert torch.equal(dbias, torch.zeros(16))


def test_internal_storages_hold_their_quantizer_but_never_a_reducing_one():
    delayed = DelayedState().quantizer()
    delayed.internal = True
    assert delayed.quantize_impl(sample())._quantizer is delayed  # no copy per cast
    reducing = Float8CurrentScalingQuantizer(E4M3, with_amax_reduction=False)
    reducing.with_amax_reduction = True  # as set up for a process group
    reducing.internal = True
    reducing._scale_and_amax = lambda src: (torch.ones(1), None)  # no process group here
    held = reducing.quantize_impl(sample())._quantizer
    assert held is not reducing and held.with_amax_reduction is False
