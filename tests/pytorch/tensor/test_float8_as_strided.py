"""``as_strided`` of a ``Float8Tensor`` stays a ``Float8Tensor`` (a view of its FP8 bytes).

The request is applied to the row-wise bytes, in the tensor's own element space. A row shard
(``t[a:b]`` expressed as ``as_strided``: the trailing sizes and contiguous strides of ``t``,
an offset on a row boundary) keeps the matching columns of the transposed copy, as dim-0
slices do; any other request drops the transposed copy; with only the transposed copy present
a row shard still works and anything else falls back to high precision. Results share the
scale: writing into one keeps it (and reaches the source's bytes).

Oracles: the FP8 cast oracle's bytes (``fp8_oracle``) with plain torch ``as_strided`` applied
to them, their last-dim-first transpose, and the oracle's float64 dequantization.
"""

from __future__ import annotations

import warnings

import fp8_oracle as oracle
import pytest
import torch

from transformer_engine.pytorch import quantized_tensor as qt_module
from transformer_engine.pytorch.tensor import Float8Quantizer, Float8Tensor

E4M3 = torch.float8_e4m3fn
SCALE = 4.0


def _quantized(shape=(8, 16), *, rowwise=True, columnwise=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    q = Float8Quantizer(
        torch.full((1,), SCALE), torch.zeros(1), E4M3, rowwise=rowwise, columnwise=columnwise
    )
    with torch.no_grad():
        t = q(x)
    return t, oracle.cast_bytes(x, torch.tensor(SCALE), E4M3)


def _values(raw):
    return oracle.dequantize(raw, oracle.reciprocal(torch.tensor([SCALE])), torch.float32, E4M3)


ROW_SHARDS = {
    "rows_4_8": ((4, 16), (16, 1), 64),
    "rows_2_5": ((3, 16), (16, 1), 32),
    "all_rows": ((8, 16), (16, 1), 0),
    "one_row_odd_stride": ((1, 16), (999, 1), 112),  # a size-1 dim's stride is free
}


@pytest.mark.parametrize("request_", list(ROW_SHARDS.values()), ids=list(ROW_SHARDS))
def test_row_shard_keeps_the_matching_transposed_columns(request_):
    t, raw = _quantized()
    size, stride, offset = request_
    got = torch.as_strided(t, size, stride, offset)
    expected = raw.as_strided(size, stride, offset)
    assert isinstance(got, Float8Tensor) and got.shape == torch.Size(size)
    assert torch.equal(got._data, expected)
    assert got._data.data_ptr() == t._data.data_ptr() + offset  # a view of the bytes
    assert torch.equal(got._transpose, oracle.transpose_last_dim_first(expected))
    assert got._scale_inv is t._scale_inv
    assert torch.equal(got.dequantize(), _values(expected))


def test_row_shard_of_a_1d_tensor():
    t, raw = _quantized((12,))
    got = torch.as_strided(t, (5,), (1,), 3)
    assert isinstance(got, Float8Tensor)
    assert torch.equal(got._data, raw[3:8]) and torch.equal(got._transpose, raw[3:8])


OTHER = {
    "column_block": ((8, 8), (16, 1), 4),
    "transposed": ((16, 8), (1, 16), 0),
    "flat_range": ((40,), (1,), 20),
    "every_other_row": ((4, 16), (32, 1), 0),
    "overlapping": ((5, 16), (8, 1), 0),
}


@pytest.mark.parametrize("request_", list(OTHER.values()), ids=list(OTHER))
def test_other_requests_view_the_bytes_and_drop_the_transpose(request_):
    t, raw = _quantized()
    size, stride, offset = request_
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no high-precision fallback
        got = torch.as_strided(t, size, stride, offset)
    expected = raw.as_strided(size, stride, offset)
    assert isinstance(got, Float8Tensor) and got.shape == torch.Size(size)
    assert got._transpose is None
    assert torch.equal(got._data, expected)
    assert got._data.untyped_storage().data_ptr() == t._data.untyped_storage().data_ptr()
    assert torch.equal(got.dequantize(), _values(expected))


def test_reshaping_a_strided_view_runs_in_high_precision():
    t, raw = _quantized()
    view = torch.as_strided(t, (8, 8), (16, 1), 4)
    qt_module._warned_ops.discard("aten.view.default")
    with pytest.warns(UserWarning, match="aten.view"):
        flat = view.reshape(-1)
    assert torch.equal(flat, _values(raw)[:, 4:12].reshape(-1))


def test_parameter_as_strided_of_itself_is_float8_and_differentiable():
    t, raw = _quantized()
    p = torch.nn.Parameter(t)
    a = p.as_strided(p.size(), p.stride())
    assert isinstance(a, Float8Tensor) and a.requires_grad
    assert torch.equal(a._data, raw) and a._transpose is not None
    shard = torch.as_strided(p, (4, 16), (16, 1), 64)
    shard.dequantize().sum().backward()
    expected_grad = torch.zeros(8, 16)
    expected_grad[4:] = 1.0
    assert torch.equal(p.grad, expected_grad)


def test_columnwise_only_row_shard_slices_the_transpose():
    t, raw = _quantized(rowwise=False)
    assert t._data is None
    got = torch.as_strided(t, (4, 16), (16, 1), 32)
    assert isinstance(got, Float8Tensor) and got._data is None
    assert torch.equal(got._transpose, oracle.transpose_last_dim_first(raw[2:6]))
    assert torch.equal(got.dequantize(), _values(raw[2:6]))


def test_columnwise_only_other_request_falls_back_to_high_precision():
    t, raw = _quantized(rowwise=False)
    qt_module._warned_ops.discard("aten.as_strided.default")  # warned once per op
    with pytest.warns(UserWarning, match="as_strided"):
        got = torch.as_strided(t, (8, 8), (16, 1), 4)
    assert type(got) is torch.Tensor
    assert torch.equal(got, _values(raw).as_strided((8, 8), (16, 1), 4))


def test_request_past_the_bytes_raises_as_torch_does():
    t, _ = _quantized()
    with pytest.raises(RuntimeError, match="out of bounds"):
        torch.as_strided(t, (8, 16), (16, 1), 4)


def test_writing_a_row_shard_keeps_the_shared_scale():
    t, raw = _quantized()
    scale_inv = t._scale_inv.clone()
    y = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.as_strided(t, (4, 16), (16, 1), 64).copy_(y)
    assert torch.equal(t._scale_inv, scale_inv)
    assert torch.equal(t._data[:4], raw[:4])
    assert torch.equal(t._data[4:], oracle.cast_bytes(y, torch.tensor(SCALE), E4M3))


def test_writing_a_strided_view_reaches_the_source_bytes():
    t, raw = _quantized()
    scale_inv = t._scale_inv.clone()
    y = torch.randn(8, 8, generator=torch.Generator().manual_seed(6))
    view = torch.as_strided(t, (8, 8), (16, 1), 4)
    with torch.no_grad():
        view.copy_(y)
    expected = raw.clone()
    expected[:, 4:12] = oracle.cast_bytes(y, torch.tensor(SCALE), E4M3)
    assert torch.equal(t._data, expected) and torch.equal(t._scale_inv, scale_inv)
    assert torch.equal(view._data, expected[:, 4:12])
