"""CPU tests of the FP8 quantizers' usages (rowwise data, columnwise transpose) and of
Float8TensorStorage: update_usage, the storage API of internal quantizers, saving and
restoring for backward, make_empty, meta tensors, and devices that never hold a transpose.
Casts are compared with tests/pytorch/fp8_oracle.py."""

from __future__ import annotations

import fp8_oracle as oracle
import pytest
import torch
from float8_tensor_helpers import E4M3, E5M2, DelayedState, sample

from transformer_engine.pytorch import quantized_tensor as qt_module
from transformer_engine.pytorch.constants import DType
from transformer_engine.pytorch.tensor import (
    Float8CurrentScalingQuantizer,
    Float8Tensor,
    Float8TensorStorage,
    QuantizedTensorStorage,
    _float8_quantize_into,
)
from transformer_engine.pytorch.tensor.storage import float8_tensor_storage

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


def test_prepare_for_saving_keeps_no_view_of_the_buffers():
    """The typed FP8 views a cast hands over (and a GEMM operand read makes) share the buffers'
    memory: after prepare_for_saving nothing in the storage may still reach that memory, or a
    release of the saved tensors would not free it."""
    q = Float8CurrentScalingQuantizer(E4M3)
    q.internal = True
    s = q(sample((32, 16)))
    s.float8_gemm_input(columnwise=False)
    s.float8_gemm_input(columnwise=True)
    tensors, _ = s.prepare_for_saving()
    saved = {t.untyped_storage().data_ptr() for t in tensors if t is not None}

    def reachable(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            for item in value:
                yield from reachable(item)

    held = [t for value in vars(s).values() for t in reachable(value)]
    assert not [t for t in held if t.untyped_storage().data_ptr() in saved]


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
