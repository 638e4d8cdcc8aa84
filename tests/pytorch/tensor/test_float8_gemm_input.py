"""The FP8 operand interface the tensor layer implements for GEMMs (``float8_gemm_input``), and the
public identity of the Float8Tensor module.

GEMMs read FP8 operands only through ``float8_gemm_input(columnwise) -> (values, scale_inv)``
(defined by cpp_extensions/float8_gemm_operand.py). Storages keep the typed views so that the
per-call GEMM path makes none; these tests pin what they return, when a view is made again,
and that a GEMM on storages equals one on the same bytes given as plain tensors.
"""

from __future__ import annotations

import pickle

import fp8_oracle as oracle
import pytest
import torch
from utils import uint8_view

from transformer_engine.pytorch.cpp_extensions import Float8GemmOperand, general_gemm
from transformer_engine.pytorch.cpp_extensions.gemm import fp8_gemm_prevalidated
from transformer_engine.pytorch.tensor import (
    Float8CurrentScalingQuantizer,
    Float8Tensor,
    Float8TensorStorage,
)
from transformer_engine.pytorch.tensor.float8_tensor import _make_float8_tensor_in_reduce_ex

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def sample(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def internal_storage(x, fp8=E4M3, columnwise=True):
    q = Float8CurrentScalingQuantizer(fp8, rowwise=True, columnwise=columnwise)
    q.internal = True
    return q(x)


def test_storage_hands_out_typed_views_of_its_bytes():
    x = sample((32, 16))
    s = internal_storage(x)
    assert isinstance(s, Float8TensorStorage) and not isinstance(s, torch.Tensor)
    data, scale_inv = s.float8_gemm_input(False)
    transpose, scale_inv_t = s.float8_gemm_input(True)
    assert data.dtype == E4M3 and data.shape == (32, 16)
    assert transpose.dtype == E4M3 and transpose.shape == (16, 32)
    assert scale_inv is s._scale_inv and scale_inv_t is s._scale_inv
    # Views, no copies: the same bytes as the storage's buffers.
    assert data.data_ptr() == s._data.data_ptr()
    assert transpose.data_ptr() == s._transpose.data_ptr()
    scale = oracle.scale_from_amax(oracle.amax(x), E4M3)
    assert torch.equal(uint8_view(data), oracle.cast_bytes(x, scale, E4M3))
    assert torch.equal(uint8_view(transpose), oracle.transpose_last_dim_first(uint8_view(data)))


def test_storage_views_are_made_once_and_again_when_a_buffer_changes():
    s = internal_storage(sample((32, 16)))
    first = s.float8_gemm_input(False)[0]
    assert s.float8_gemm_input(False)[0] is first  # no view per call
    replacement = s._data.clone()
    s._data = replacement
    again = s.float8_gemm_input(False)[0]
    assert again is not first and again.data_ptr() == replacement.data_ptr()
    assert s.float8_gemm_input(False)[0] is again


def test_dropping_a_layout_drops_its_view():
    s = internal_storage(sample((32, 16)))
    transpose = s.float8_gemm_input(True)[0]
    data_storage = s._data.untyped_storage()
    s.update_usage(rowwise_usage=False, columnwise_usage=True)
    assert s.float8_gemm_input(False) == (None, s._scale_inv)
    assert s.float8_gemm_input(True)[0] is transpose  # the kept layout keeps its view
    # Nothing in the storage refers to the dropped row-wise bytes any more.
    held = [v for v in vars(s).values() if isinstance(v, tuple)]
    assert all(t.untyped_storage().data_ptr() != data_storage.data_ptr()
               for pair in held for t in pair)  # fmt: skip
    s.clear()
    assert s.float8_gemm_input(True) == (None, s._scale_inv)


def test_float8_tensor_keeps_no_views():
    q = Float8CurrentScalingQuantizer(E5M2)
    t = q(sample((16, 32)))
    assert isinstance(t, Float8Tensor)
    before = set(vars(t))
    data, scale_inv = t.float8_gemm_input(False)
    transpose, _ = t.float8_gemm_input(True)
    assert data.dtype == E5M2 and transpose.dtype == E5M2 and scale_inv is t._scale_inv
    assert data.data_ptr() == t._data.data_ptr()
    assert set(vars(t)) == before


def test_prevalidated_gemm_on_storages_equals_general_gemm_on_plain_tensors():
    w = internal_storage(sample((16, 32), seed=1))
    x = internal_storage(sample((48, 32), seed=2))
    dy = internal_storage(sample((48, 16), seed=3), fp8=E5M2)

    def plain(s):
        return Float8GemmOperand(
            s.float8_gemm_input(False)[0], s.float8_gemm_input(True)[0], s._scale_inv
        )

    for a, b, layout in ((w, x, "TN"), (w, dy, "NN"), (x, dy, "NT")):
        fast = fp8_gemm_prevalidated(a, b, torch.float32, layout=layout)
        checked = general_gemm(plain(a), plain(b), torch.float32, layout=layout)[0]
        assert torch.equal(fast, checked)


def test_reconstructor_keeps_its_public_name_in_pickles():
    t = Float8CurrentScalingQuantizer(E4M3)(sample((4, 16)))
    assert _make_float8_tensor_in_reduce_ex.__module__ == (
        "transformer_engine.pytorch.tensor.float8_tensor"
    )
    payload = pickle.dumps(t)
    assert b"transformer_engine.pytorch.tensor.float8_tensor" in payload
    assert b"_float8_tensor_class" not in payload
    restored = pickle.loads(payload)
    assert torch.equal(restored._data, t._data) and restored._quantizer is None


def _devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prevalidated_gemm_writes_the_rows_it_is_given(device, out_dtype, with_bias):
    """``out=`` a view of some rows of a larger output (a pipelined GEMM's chunk): the rows
    hold what the GEMM returns without ``out`` (on CUDA cuBLAS writes them directly) and the
    rest of the output is untouched."""
    w = internal_storage(sample((32, 64), seed=1).to(device))
    x = internal_storage(sample((48, 64), seed=2).to(device))
    bias = sample((32,), seed=3).to(device, out_dtype) if with_bias else None
    want = fp8_gemm_prevalidated(w, x, out_dtype, layout="TN", bias=bias)
    whole = torch.full((96, 32), 7.0, dtype=out_dtype, device=device)
    rows = whole[16:64]
    got = fp8_gemm_prevalidated(w, x, out_dtype, layout="TN", bias=bias, out=rows)
    assert got.data_ptr() == rows.data_ptr()
    assert torch.equal(whole[16:64], want)
    assert bool((whole[:16] == 7).all()) and bool((whole[64:] == 7).all())
