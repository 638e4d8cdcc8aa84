"""The block-scaled cast wrappers (cpp_extensions/block_cast.py) on the CPU: routing to the
reference in the stored layouts, in-place writes and the no-op flag, argument validation, the
quantizers' use of them, and the native binding's own argument checks (which run before any
CUDA call, so they are testable without a GPU). Bitwise native-vs-reference runs are in
test_block_cast_kernels.py (GPU)."""

import pytest
import torch
from utils import bitwise_equal

from transformer_engine.common.native import native_module
from transformer_engine.pytorch import reference_blocks
from transformer_engine.pytorch.cpp_extensions import block_cast
from transformer_engine.pytorch.cpp_extensions.block_cast import (
    BlockCastResult,
    float8_block_cast,
    float8_block_scale_shape,
    mxfp8_block_cast,
    mxfp8_scale_shape,
)
from transformer_engine.pytorch.device import DevicePlacementError
from transformer_engine.pytorch.tensor import Float8BlockQuantizer, MXFP8Quantizer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def rand(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 30).to(dtype)


# ------------------------------------------------------------------ routing to the reference


@pytest.mark.parametrize("shape", [(5, 300), (130, 7), (1, 1)])
def test_float8_1d_is_the_reference_in_the_stored_layouts(shape):
    x = rand(shape, torch.bfloat16)
    got = float8_block_cast(x, E4M3, block_scaling_dim=1, rowwise=True, columnwise=True,
                            epsilon=0.0, force_pow_2_scales=False)  # fmt: skip
    opts = dict(epsilon=0.0, force_pow_2_scales=False, value_for_inf=torch.finfo(x.dtype).max)
    row, row_s = reference_blocks.block_cast_1d(x, E4M3, **opts)
    col, col_s = reference_blocks.block_cast_1d(x.t(), E4M3, **opts)
    assert got.rowwise_data.dtype == torch.uint8
    assert bitwise_equal(got.rowwise_data, row.view(torch.uint8))
    assert bitwise_equal(got.rowwise_scale_inv, row_s)
    assert bitwise_equal(got.columnwise_data, col.view(torch.uint8))
    assert bitwise_equal(got.columnwise_scale_inv, col_s)
    assert got.rowwise_scale_inv.shape == float8_block_scale_shape(shape, 1, False)
    assert got.columnwise_scale_inv.shape == float8_block_scale_shape(shape, 1, True)


def test_float8_2d_columnwise_is_the_transposed_rowwise():
    x = rand((200, 300))
    got = float8_block_cast(x, E5M2, block_scaling_dim=2, rowwise=True, columnwise=True)
    data, scale = reference_blocks.block_cast_2d(x, E5M2)
    assert bitwise_equal(got.rowwise_data, data.view(torch.uint8))
    assert bitwise_equal(got.rowwise_scale_inv, scale)
    assert bitwise_equal(got.columnwise_data, data.view(torch.uint8).t().contiguous())
    # (KB, roundup(MB, 4)) = (3, 4): the transposed block scales, padding zero
    assert got.columnwise_scale_inv.shape == (3, 4)
    assert bitwise_equal(got.columnwise_scale_inv[:, :2], scale[:2, :3].t().contiguous())
    assert torch.all(got.columnwise_scale_inv[:, 2:] == 0)


def test_float8_3d_input_columnwise_shape():
    x = rand((2, 3, 140))
    got = float8_block_cast(x, E4M3, block_scaling_dim=1, rowwise=False, columnwise=True)
    assert got.rowwise_data is None and got.rowwise_scale_inv is None
    assert got.columnwise_data.shape == (140, 2, 3)
    assert got.columnwise_scale_inv.shape == (1, 140)


@pytest.mark.parametrize("two_d", [False, True])
def test_mxfp8_is_the_reference_in_the_stored_layouts(two_d):
    x = rand((70, 100), torch.float16, seed=1)
    got = mxfp8_block_cast(x, E4M3, rowwise=True, columnwise=True, two_d=two_d)
    assert got.rowwise_scale_inv.shape == mxfp8_scale_shape(x.shape, False) == (128, 4)
    assert got.columnwise_scale_inv.shape == mxfp8_scale_shape(x.shape, True) == (4, 128)
    if two_d:
        data, e = reference_blocks.mxfp8_cast(x, E4M3, two_d=True)
        assert bitwise_equal(got.rowwise_data, data.view(torch.uint8))
        assert bitwise_equal(got.columnwise_data, data.view(torch.uint8))
        assert bitwise_equal(got.rowwise_scale_inv[:70, :4], e.repeat_interleave(32, 0)[:70])
        assert bitwise_equal(
            got.columnwise_scale_inv[:3, :100], e.repeat_interleave(32, 1)[:, :100]
        )
    else:
        data, e = reference_blocks.mxfp8_cast(x, E4M3)
        assert bitwise_equal(got.rowwise_data, data.view(torch.uint8))
        assert bitwise_equal(got.rowwise_scale_inv[:70, :4], e)
        cdata, ce = reference_blocks.mxfp8_cast(x.t(), E4M3)
        assert bitwise_equal(got.columnwise_data, cdata.view(torch.uint8).t().contiguous())
        assert bitwise_equal(got.columnwise_scale_inv[:3, :100], ce.t().contiguous())
    assert torch.all(got.rowwise_scale_inv[70:] == 0)
    assert torch.all(got.columnwise_scale_inv[3:] == 0)
    assert torch.all(got.columnwise_scale_inv[:, 100:] == 0)


@pytest.mark.parametrize("shape", [(0,), (0, 128), (5, 0), ()])
def test_empty_and_scalar_inputs(shape):
    x = torch.zeros(shape)
    got = float8_block_cast(x, E4M3, block_scaling_dim=1, rowwise=True, columnwise=True)
    assert got.rowwise_data.shape == shape
    assert got.rowwise_scale_inv.shape == float8_block_scale_shape(shape, 1, False)
    mx = mxfp8_block_cast(x, E4M3, rowwise=True, columnwise=True)
    assert mx.columnwise_data.shape == shape
    assert mx.columnwise_scale_inv.shape == mxfp8_scale_shape(shape, True)


# ------------------------------------------------------------------ in place and the no-op flag


def _filled_like(result):
    out = []
    for t in result:
        b = torch.empty_like(t)
        b.view(torch.uint8).fill_(0xA5)
        out.append(b)
    return BlockCastResult(*out)


@pytest.mark.parametrize("kind", ["float8", "mxfp8"])
def test_out_and_noop_flag_on_cpu(kind):
    x = rand((40, 260), torch.bfloat16, seed=2)

    def cast(**kw):
        if kind == "mxfp8":
            return mxfp8_block_cast(x, E4M3, rowwise=True, columnwise=True, **kw)
        return float8_block_cast(x, E4M3, block_scaling_dim=1, rowwise=True, columnwise=True, **kw)

    want = cast()
    out = _filled_like(want)
    before = [t.clone() for t in out]
    assert cast(out=out, noop_flag=torch.ones(1)) is out
    assert all(bitwise_equal(a, b) for a, b in zip(before, out))
    cast(out=out, noop_flag=torch.zeros(1))
    assert all(bitwise_equal(a, b) for a, b in zip(want, out))
    # FP8-typed data buffers are accepted too
    out8 = BlockCastResult(want.rowwise_data.view(E4M3).clone().zero_(), out[1],
                           want.columnwise_data.view(E4M3).clone().zero_(), out[3])  # fmt: skip
    cast(out=out8)
    assert bitwise_equal(out8.rowwise_data.view(torch.uint8), want.rowwise_data)


def test_quantizer_update_with_noop_flag_on_cpu():
    x, y = rand((64, 256), seed=3), rand((64, 256), seed=4)
    for q in (Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=1),
              MXFP8Quantizer(E5M2)):  # fmt: skip
        t = q.quantize(x)
        kept = t._rowwise_data.clone()
        q.update_quantized(y, t, noop_flag=torch.ones(1))
        assert bitwise_equal(t._rowwise_data, kept)
        q.update_quantized(y, t, noop_flag=torch.zeros(1))
        fresh = q.quantize(y)
        for name in ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
                     "_columnwise_scale_inv"):  # fmt: skip
            assert bitwise_equal(getattr(t, name), getattr(fresh, name)), name


def test_quantizer_update_keeps_the_flag_semantics_when_the_format_changes():
    x = rand((8, 128))
    t = Float8BlockQuantizer(E4M3, rowwise=True, columnwise=False, block_scaling_dim=1).quantize(x)
    other = Float8BlockQuantizer(E5M2, rowwise=True, columnwise=False, block_scaling_dim=1)
    kept = t._rowwise_data.clone()
    other.update_quantized(x * 2, t, noop_flag=torch.ones(1))
    assert bitwise_equal(t._rowwise_data, kept)
    assert t._fp8_dtype == Float8BlockQuantizer(E4M3, rowwise=True, columnwise=False).dtype


# ------------------------------------------------------------------ validation


def test_validation_messages():
    x = rand((4, 128))
    kw = dict(block_scaling_dim=1, rowwise=True, columnwise=True)
    with pytest.raises(TypeError, match="input has dtype torch.int32"):
        float8_block_cast(x.int(), E4M3, **kw)
    with pytest.raises(ValueError, match="both False"):
        float8_block_cast(x, E4M3, block_scaling_dim=1, rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="block_scaling_dim=3"):
        float8_block_cast(x, E4M3, block_scaling_dim=3, rowwise=True, columnwise=False)
    with pytest.raises(ValueError, match="block_scaling_dim=True"):
        float8_block_cast(x, E4M3, block_scaling_dim=True, rowwise=True, columnwise=False)
    for eps in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="epsilon"):
            float8_block_cast(x, E4M3, epsilon=eps, **kw)
    with pytest.raises(ValueError, match="noop_flag needs out="):
        float8_block_cast(x, E4M3, noop_flag=torch.zeros(1), **kw)
    with pytest.raises(TypeError, match="noop_flag must be float32"):
        mxfp8_block_cast(x, E4M3, rowwise=True, columnwise=False, noop_flag=torch.zeros(1).half())
    good = float8_block_cast(x, E4M3, **kw)
    with pytest.raises(ValueError, match=r"out.rowwise_scale_inv has shape \(1, 8\)"):
        float8_block_cast(x, E4M3, out=good._replace(rowwise_scale_inv=torch.zeros(1, 8)), **kw)
    with pytest.raises(TypeError, match="out.columnwise_scale_inv has dtype"):
        bad = good._replace(columnwise_scale_inv=good.columnwise_scale_inv.double())
        float8_block_cast(x, E4M3, out=bad, **kw)
    with pytest.raises(ValueError, match="out.columnwise_data is None"):
        float8_block_cast(x, E4M3, out=good._replace(columnwise_data=None), **kw)
    with pytest.raises(ValueError, match="must be contiguous"):
        strided = torch.zeros(4, 256, dtype=torch.uint8)[:, ::2]
        float8_block_cast(x, E4M3, out=good._replace(rowwise_data=strided), **kw)
    with pytest.raises(DevicePlacementError, match="meta"):
        float8_block_cast(x.to("meta"), E4M3, **kw)
    with pytest.raises(ValueError, match=r"out.rowwise_scale_inv has shape"):
        mx = mxfp8_block_cast(x, E4M3, rowwise=True, columnwise=False)
        mxfp8_block_cast(x, E4M3, rowwise=True, columnwise=False,
                         out=mx._replace(rowwise_scale_inv=torch.zeros(4, 4, dtype=torch.uint8)))  # fmt: skip


def test_cpu_tensors_never_reach_the_native_library(monkeypatch):
    calls = []
    monkeypatch.setattr(block_cast, "native_for", lambda op, device: calls.append(op))
    float8_block_cast(rand((3, 5)), E4M3, block_scaling_dim=2, rowwise=True, columnwise=False)
    mxfp8_block_cast(rand((3, 5)), E4M3, rowwise=True, columnwise=False)
    # the route is asked (CPU: None, the reference) and nothing else is called
    assert calls == ["float8_block_cast", "mxfp8_block_cast"]


# ------------------------------------------------------------------ the native binding's checks


def _native_with_block_casts():
    module = native_module()
    if module is None:
        pytest.skip("the native library is not built here; the GPU tests cover the binding")
    if not hasattr(module, "block_scaled_quantize"):
        pytest.skip("the loaded native library predates the block casts; rebuild it")
    return module


def _arg(shape, code, ptr=0x1000):
    return (ptr, list(shape), code)


F32, BF16, BYTE, E4 = 4, 6, 0, 7


def test_native_argument_checks_run_before_any_cuda_call():
    native = _native_with_block_casts()
    x = _arg((256, 300), BF16)
    row, row_s = _arg((256, 300), E4), _arg((3, 256), F32)
    col, col_s = _arg((300, 256), E4), _arg((2, 300), F32)
    call = native.block_scaled_quantize
    with pytest.raises(ValueError, match="block_scaling_dim=3"):
        call(x, row, row_s, col, col_s, 3, 0.0, True, None, 0, 0)
    with pytest.raises(ValueError, match="epsilon"):
        call(x, row, row_s, col, col_s, 1, -1.0, True, None, 0, 0)
    with pytest.raises(ValueError, match=r"rowwise_scale_inv has shape \(2, 256\).*\(3, 256\)"):
        call(x, row, _arg((2, 256), F32), col, col_s, 1, 0.0, True, None, 0, 0)
    with pytest.raises(ValueError, match="first extent"):
        call(x, row, row_s, _arg((256, 300), E4), col_s, 1, 0.0, True, None, 0, 0)
    with pytest.raises(ValueError, match="one FP8 format"):
        call(x, row, row_s, _arg((300, 256), 8), col_s, 1, 0.0, True, None, 0, 0)
    with pytest.raises(ValueError, match="both null"):
        call(x, None, None, None, None, 1, 0.0, True, None, 0, 0)
    with pytest.raises(ValueError, match="rowwise_scale_inv is required"):
        call(x, row, None, None, None, 1, 0.0, True, None, 0, 0)
    # 2-D: (MB, roundup(KB, 4)) and (KB, roundup(MB, 4))
    with pytest.raises(ValueError, match=r"columnwise_scale_inv has shape \(2, 300\).*\(3, 4\)"):
        call(x, row, _arg((2, 4), F32), col, col_s, 2, 0.0, True, None, 0, 0)
    mx = native.mxfp8_quantize
    with pytest.raises(ValueError, match=r"rowwise_scale_inv has shape \(256, 10\).*\(256, 12\)"):
        mx(x, row, _arg((256, 10), BYTE), None, None, False, None, 0, 0)
    with pytest.raises(ValueError, match="input has dtype"):
        mx(_arg((256, 300), BYTE), row, _arg((256, 12), BYTE), None, None, False, None, 0, 0)
