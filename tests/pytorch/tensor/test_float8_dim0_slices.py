"""Slices of a ``Float8Tensor`` along dim 0 keep a correct transposed copy.

``t[a:b]``, ``t.narrow(0, ...)``, ``t.split(...)`` and ``t[i]`` of a tensor that holds the
column-wise layout give results that hold it too: the matching columns of the source's transposed
copy, as a new contiguous tensor. Oracles: the FP8 cast oracle's bytes (``fp8_oracle``) sliced
with plain torch indexing, and their last-dim-first transpose.
"""

from __future__ import annotations

import fp8_oracle as oracle
import pytest
import torch
from tolerances import assert_close_by_table
from utils import needs_cuda

from transformer_engine.pytorch.cpp_extensions import general_gemm
from transformer_engine.pytorch.tensor import Float8Quantizer, Float8Tensor

E4M3 = torch.float8_e4m3fn
SCALE = 2.0

# Each op runs on the Float8Tensor and, as the oracle, on the plain uint8 bytes of the same cast.
OPS = {
    "slice": lambda t: t[2:5],
    "slice_negative": lambda t: t[-3:],
    "narrow": lambda t: t.narrow(0, 1, 4),
    "split_even": lambda t: t.split(2),
    "split_sizes": lambda t: t.split([1, 5]),
    "split_dim_kw": lambda t: t.split(3, dim=0),
    "select": lambda t: t[4],
}


def _quantized(shape, *, rowwise=True, columnwise=True, device="cpu"):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(shape, generator=g) * 3).to(device)
    q = Float8Quantizer(
        scale=torch.full((1,), SCALE, device=device),
        amax=torch.zeros(1, device=device),
        fp8_dtype=E4M3,
        rowwise=rowwise,
        columnwise=columnwise,
    )
    with torch.no_grad():
        t = q(x)
    raw = oracle.cast_bytes(x.cpu(), torch.tensor(SCALE), E4M3)  # uint8, the source's bytes
    return t, raw


def _as_list(result):
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _expected_values(raw_part):
    return oracle.dequantize(
        raw_part, oracle.reciprocal(torch.tensor([SCALE])), torch.float32, E4M3
    )


@pytest.mark.parametrize("shape", [(6, 16), (6, 3, 16), (6,)], ids=["2d", "3d", "1d"])
@pytest.mark.parametrize("op", list(OPS), ids=list(OPS))
def test_dim0_slices_keep_the_transposed_columns(shape, op):
    t, raw = _quantized(shape)
    got, expected = _as_list(OPS[op](t)), _as_list(OPS[op](raw))
    assert len(got) == len(expected)
    for part, raw_part in zip(got, expected, strict=True):
        assert isinstance(part, Float8Tensor) and part.shape == raw_part.shape
        assert torch.equal(part._data.view(torch.uint8), raw_part)
        assert part._transpose is not None and part._transpose.is_contiguous()
        if raw_part.dim() == 0:
            assert torch.equal(part._transpose.view(torch.uint8), raw_part)
        else:
            assert torch.equal(part._transpose.view(torch.uint8),
                               oracle.transpose_last_dim_first(raw_part))  # fmt: skip
        assert torch.equal(part.dequantize(), _expected_values(raw_part))
        assert part._scale_inv is t._scale_inv  # one per-tensor scale, shared


@pytest.mark.parametrize("op", ["slice", "narrow", "split_sizes", "select"])
def test_columnwise_only_source_slices_its_transpose(op):
    t, raw = _quantized((6, 3, 16), rowwise=False)
    assert t._data is None
    for part, raw_part in zip(_as_list(OPS[op](t)), _as_list(OPS[op](raw)), strict=True):
        assert isinstance(part, Float8Tensor) and part._data is None
        assert torch.equal(part._transpose.view(torch.uint8),
                           oracle.transpose_last_dim_first(raw_part))  # fmt: skip
        assert torch.equal(part.dequantize(), _expected_values(raw_part))


def test_rowwise_only_source_slices_stay_rowwise():
    t, raw = _quantized((6, 16), columnwise=False)
    part = t[1:3]
    assert part._transpose is None and torch.equal(part._data.view(torch.uint8), raw[1:3])


def test_slice_transpose_is_a_copy_and_the_row_bytes_a_view():
    t, _ = _quantized((6, 16))
    part = t[2:5]
    assert part._data.data_ptr() == t._data[2].data_ptr()
    assert part._transpose.untyped_storage().data_ptr() != t._transpose.untyped_storage().data_ptr()


FP8_GEMM_ROW = ("fp8_dequantized_fast_accum", torch.float32)


def _check_gemms_read_the_sliced_transpose(device):
    """dgrad (NN) reads A's column-wise layout, wgrad (NT) both operands': with dim-0 slices as
    operands the products are those of the sliced values (float64 oracle)."""
    w, w_raw = _quantized((48, 32), device=device)
    dy, dy_raw = _quantized((32, 32), device=device)
    x, x_raw = _quantized((16, 16), device=device)
    w_vals = _expected_values(w_raw[16:32]).double()  # [16, 32]
    dy_vals = _expected_values(dy_raw[8:24]).double()  # [16, 32]
    x_vals = _expected_values(x_raw).double()
    dx = general_gemm(w[16:32], x, torch.float32, layout="NN")[0]  # x @ W': [16, 32]
    # Hopper's FP8 tensor cores accumulate in reduced precision: the GEMM table's FP8 row.
    assert_close_by_table(dx.double().cpu(), x_vals @ w_vals, FP8_GEMM_ROW)
    dw = general_gemm(w[16:32], dy[8:24], torch.float32, layout="NT")[0]  # dy'^T @ W': [32, 32]
    assert_close_by_table(dw.double().cpu(), dy_vals.t() @ w_vals, FP8_GEMM_ROW)


def test_gemms_read_the_sliced_transpose():
    _check_gemms_read_the_sliced_transpose("cpu")


@needs_cuda
def test_gemms_read_the_sliced_transpose_gpu():
    _check_gemms_read_the_sliced_transpose(torch.device("cuda", torch.cuda.current_device()))
