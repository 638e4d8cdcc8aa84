"""``copy_`` between block-scaled tensors (Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor).

A source of the destination's kind, format (FP8 dtype, block shape, column-wise RHT), shape and
usages is copied buffer by buffer: the destination ends up with the source's bytes and scales,
every layout (re-quantizing from the dequantized source rounded the column-wise copy a second
time, so a loaded MXFP8 / NVFP4 / 1x128-block weight differed from the saved one). Any other
source is re-quantized into the destination with its own quantizer, as before.

Oracles: the source's buffers cloned before the copy; the float64 MXFP8 loop oracle
(``mxfp8_oracle``) for the column-wise values decoded by hand from the destination's bytes.
"""

from __future__ import annotations

import pytest
import torch
from mxfp8_oracle import oracle_dequantize

from transformer_engine.pytorch.constants import DType
from transformer_engine.pytorch.tensor import (
    Float8BlockQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizedTensor,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

QUANTIZERS = {
    "block1d": lambda: Float8BlockQuantizer(
        DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=1
    ),
    "block1d_nonpow2": lambda: Float8BlockQuantizer(
        DType.kFloat8E4M3,
        rowwise=True,
        columnwise=True,
        block_scaling_dim=1,
        force_pow_2_scales=False,
    ),
    "block2d": lambda: Float8BlockQuantizer(
        DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=2
    ),
    "mxfp8": lambda: MXFP8Quantizer(DType.kFloat8E4M3),
    "nvfp4": lambda: NVFP4Quantizer(),
    "nvfp4_rht": lambda: NVFP4Quantizer(with_rht=True, with_post_rht_amax=True),
}


def _sample(shape=(256, 256), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _buffers(t) -> dict[str, torch.Tensor | None]:
    return {name: getattr(t, name) for name in t._buffer_names}


def _saved(t) -> dict[str, torch.Tensor | None]:
    return {n: None if b is None else b.clone() for n, b in _buffers(t).items()}


def _assert_buffers_equal(t, saved):
    for name, expected in saved.items():
        got = getattr(t, name)
        if expected is None:
            assert got is None, name
        else:
            assert torch.equal(got, expected), f"{name} differs from the source's bytes"


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_copy_from_the_same_kind_copies_every_buffer(kind):
    src = QUANTIZERS[kind]()(_sample())
    dst = QUANTIZERS[kind]()(_sample(seed=1) * 7)
    expected = _saved(src)
    before = {n: None if b is None else b.data_ptr() for n, b in _buffers(dst).items()}
    with torch.no_grad():
        out = dst.copy_(src)
    assert out is dst
    _assert_buffers_equal(dst, expected)
    # in place: the destination keeps its buffers (views and optimizers may hold them)
    assert {n: None if b is None else b.data_ptr() for n, b in _buffers(dst).items()} == before
    _assert_buffers_equal(src, expected)  # the source is untouched


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_load_state_dict_loads_the_saved_bytes(kind):
    quantizer = QUANTIZERS[kind]
    saved = quantizer()(_sample(seed=2))
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(quantizer()(torch.zeros(256, 256)), requires_grad=True)
    expected = _saved(saved)
    module.load_state_dict({"w": saved})
    assert isinstance(module.w, QuantizedTensor) and isinstance(module.w, torch.nn.Parameter)
    _assert_buffers_equal(module.w, expected)


def _mxfp8_columnwise_values(t) -> torch.Tensor:
    """The column-wise copy decoded by hand: E4M3 byte times 2^(e - 127), blocks of 32 along
    the rows of the logical ``[M, K]`` matrix (scales ``[M/32, K]``)."""
    values = t._columnwise_data.view(E4M3).double()
    m, k = values.shape
    exps = t._columnwise_scale_inv[: m // 32, :k].double()
    return values * torch.pow(2.0, exps - 127).repeat_interleave(32, dim=0)


def test_mxfp8_copy_keeps_the_columnwise_values_of_one_cast():
    x = _sample((64, 96), seed=3) * torch.exp2(torch.arange(96) % 7 - 3.0)
    src = MXFP8Quantizer(DType.kFloat8E4M3)(x)
    dst = MXFP8Quantizer(DType.kFloat8E4M3)(torch.zeros(64, 96))
    with torch.no_grad():
        dst.copy_(src)
    expected = oracle_dequantize(x, E4M3, columnwise=True)
    assert torch.equal(_mxfp8_columnwise_values(dst), expected)


def test_other_usages_are_requantized_into_the_destination_layouts():
    src = MXFP8Quantizer(DType.kFloat8E4M3)(_sample(seed=4))
    dst = MXFP8Quantizer(DType.kFloat8E4M3, columnwise=False)(torch.zeros(256, 256))
    with torch.no_grad():
        dst.copy_(src)
    assert dst._columnwise_data is None  # the destination's usages are kept
    # re-quantized from the source's (row-wise) values: a row-wise copy holds them exactly
    assert torch.equal(dst.dequantize(), src.dequantize())


@pytest.mark.parametrize(
    "make_src, make_dst, check",
    [
        (
            lambda: MXFP8Quantizer(DType.kFloat8E4M3),
            lambda: MXFP8Quantizer(DType.kFloat8E5M2),
            lambda dst: dst._fp8_dtype == DType.kFloat8E5M2,
        ),
        (
            QUANTIZERS["block1d"],
            QUANTIZERS["block2d"],
            lambda dst: dst._is_2D_scaled,
        ),
        (
            QUANTIZERS["nvfp4"],
            QUANTIZERS["nvfp4_rht"],
            lambda dst: dst._columnwise_rht,
        ),
    ],
    ids=["fp8_dtype", "block_dims", "rht"],
)
def test_another_format_is_requantized_in_the_destination_format(make_src, make_dst, check):
    x = _sample(seed=5)
    src, dst = make_src()(x), make_dst()(torch.zeros(256, 256))
    with torch.no_grad():
        dst.copy_(src)
    assert check(dst)
    # what the destination's quantizer makes of the source's values
    expected = make_dst()(src.dequantize())
    _assert_buffers_equal(dst, _saved(expected))


def test_plain_source_and_destination_still_convert():
    x = _sample(seed=6)
    dst = MXFP8Quantizer(DType.kFloat8E4M3)(torch.zeros(256, 256))
    with torch.no_grad():
        dst.copy_(x)
    _assert_buffers_equal(dst, _saved(MXFP8Quantizer(DType.kFloat8E4M3)(x)))
    plain = torch.empty(256, 256)
    plain.copy_(dst)
    assert torch.equal(plain, dst.dequantize())
