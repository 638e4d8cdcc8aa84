"""MXFP8Quantizer / MXFP8Tensor / MXFP8TensorStorage and the emulated MXFP8 GEMM.

The cast is held byte-exact to the float64 loop oracle (``mxfp8_oracle``); the GEMM to the
float64 product of the oracle-dequantized copies each layout reads (only float32 accumulation
of exact products differs: rtol 1e-5).
"""

import pytest
import torch
from mxfp8_oracle import oracle_cast, oracle_dequantize, oracle_exponent
from utils import needs_cuda

from transformer_engine.pytorch.cpp_extensions.gemm import general_gemm
from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor
from transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage import MXFP8TensorStorage

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(1, 1), (1, 33), (0, 64), (5, 70), (64, 96), (3, 4, 40)]


def _up(a, b):
    return -(-a // b) * b


def _sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 6, shape, generator=g))
    return x.to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_bytes_and_scales_match_oracle(shape, fp8, dtype):
    x = _sample(shape, dtype)
    t = MXFP8Quantizer(fp8)(x)
    m = x.reshape(-1, shape[-1])
    rows, k = m.shape
    data, e = oracle_cast(m, fp8)
    assert torch.equal(t._rowwise_data.reshape(rows, k), data)
    assert tuple(t._rowwise_scale_inv.shape) == (_up(rows, 128), _up(_up(k, 32) // 32, 4))
    assert torch.equal(t._rowwise_scale_inv[:rows, : e.shape[1]], e)
    cdata, ce = oracle_cast(m.t(), fp8)  # blocks along the rows
    assert torch.equal(t._columnwise_data.reshape(rows, k), cdata.t())
    assert tuple(t._columnwise_scale_inv.shape) == (_up(_up(rows, 32) // 32, 4), _up(k, 128))
    assert torch.equal(t._columnwise_scale_inv[: ce.shape[1], :k], ce.t())
    # Padding entries are zero.
    assert int(t._rowwise_scale_inv.sum()) == int(e.sum())
    assert int(t._columnwise_scale_inv.sum()) == int(ce.sum())


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_scale_exponent_rule(fp8):
    fmax = 448.0 if fp8 == E4M3 else 57344.0
    cases = {0.0: 0, fmax: 127, fmax * 2.0**5: 132, fmax * 2.0**-3: 124, fmax * 1.01: 128}
    for amax, expected in cases.items():
        assert oracle_exponent(amax, fp8) == expected
        x = torch.zeros(1, 32)
        x[0, 7] = -amax
        t = MXFP8Quantizer(fp8, columnwise=False)(x)
        assert int(t._rowwise_scale_inv[0, 0]) == expected
        # The block's amax fits the format after scaling by 2^(127-e).
        if amax:
            assert amax * 2.0 ** (127 - expected) <= fmax


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_dequantize_bounds_and_columnwise(fp8):
    x = _sample((64, 96), torch.float32, seed=3)
    t = MXFP8Quantizer(fp8)(x)
    mbits = 3 if fp8 == E4M3 else 2
    e = t._rowwise_scale_inv[:64, :3].double().repeat_interleave(32, dim=1)
    subnormal = 2.0 ** (-6 if fp8 == E4M3 else -14)
    bound = 2.0 ** -(mbits + 1) * x.abs().double() + 2.0 ** (e - 127) * subnormal * 2.0**-mbits
    assert ((t.dequantize().double() - x.double()).abs() <= bound).all()
    assert torch.equal(t.dequantize().double(), oracle_dequantize(x, fp8))
    col = t.mxfp8_gemm_input(columnwise=True).double()
    assert torch.equal(col, oracle_dequantize(x, fp8, columnwise=True))
    # Without the row-wise copy, dequantize reads the column-wise one.
    t.update_usage(rowwise_usage=False)
    assert torch.equal(t.dequantize().double(), col)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(1, 33), (5, 70), (33, 64), (96, 64), (3, 40, 40), (256, 512)])
def test_columnwise_gemm_input_values_and_layout(fp8, shape):
    """The column-wise copy's GEMM input (its FP8 bytes transposed first, then dequantized row
    by row) equals the float64 oracle's dequantize of the column-wise cast, partial blocks
    included, and comes column-major: the layout the emulated GEMM has always been given."""
    x = _sample(shape, torch.float32, seed=7)
    t = MXFP8Quantizer(fp8)(x)
    col = t.mxfp8_gemm_input(columnwise=True)
    m = x.numel() // shape[-1]
    assert col.shape == (m, shape[-1]) and col.dtype == torch.float32
    assert torch.equal(col.double(), oracle_dequantize(x.reshape(m, -1), fp8, columnwise=True))
    assert col.t().is_contiguous()


def test_two_d_blocks_shared_by_both_copies():
    x = _sample((40, 70), torch.float32, seed=4)
    t = MXFP8Quantizer(E4M3, with_2d_quantization=True)(x)
    data, e = oracle_cast(x, E4M3, two_d=True)
    assert torch.equal(t._rowwise_data, data) and torch.equal(t._columnwise_data, data)
    assert torch.equal(t._rowwise_scale_inv[:40, :3], e.repeat_interleave(32, 0)[:40])
    assert torch.equal(t._columnwise_scale_inv[:2, :70], e.repeat_interleave(32, 1)[:, :70])
    assert torch.equal(t.dequantize().double(), oracle_dequantize(x, E4M3, two_d=True))


@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_emulated_gemm_matches_float64_of_the_copies_read(layout):
    q = MXFP8Quantizer(E4M3)
    x, w, dy = (
        _sample(s, torch.float32, seed=i) for i, s in enumerate([(48, 64), (96, 64), (48, 96)])
    )
    if layout == "TN":  # fprop: x @ w^T, row-wise copies
        out, *_ = general_gemm(q(w), q(x), torch.float32, layout="TN")
        ref = oracle_dequantize(x, E4M3) @ oracle_dequantize(w, E4M3).t()
    elif layout == "NN":  # dgrad: dy @ w, w's column-wise copy (blocks along N)
        out, *_ = general_gemm(q(w), q(dy), torch.float32, layout="NN")
        ref = oracle_dequantize(dy, E4M3) @ oracle_dequantize(w, E4M3, columnwise=True)
    else:  # wgrad: dy^T @ x, both column-wise (blocks along the tokens)
        out, *_ = general_gemm(q(x), q(dy), torch.float32, layout="NT")
        ref = oracle_dequantize(dy, E4M3, columnwise=True).t() @ oracle_dequantize(
            x, E4M3, columnwise=True
        )
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_gemm_refuses_missing_copy():
    q = MXFP8Quantizer(E4M3, columnwise=False)
    w, x = q(torch.randn(32, 64)), q(torch.randn(32, 32))
    with pytest.raises(ValueError, match="columnwise"):
        general_gemm(w, x, torch.float32, layout="NN")


def test_tensor_ops_keep_blocks():
    x = torch.randn(4, 8, 64)
    t = MXFP8Quantizer(E4M3)(x)
    assert isinstance(t, MXFP8Tensor) and t.dtype == torch.float32
    v = t.view(32, 64)
    assert isinstance(v, MXFP8Tensor) and v._rowwise_data.data_ptr() == t._rowwise_data.data_ptr()
    assert torch.equal(v.dequantize(), t.dequantize().reshape(32, 64))
    with pytest.raises(RuntimeError, match="last dim"):
        t.view(4, 512)
    c = t.clone()
    assert (
        torch.equal(c.dequantize(), t.dequantize())
        and c._rowwise_data.data_ptr() != t._rowwise_data.data_ptr()
    )
    assert isinstance(t.detach(), MXFP8Tensor)
    assert torch.equal((t + 1), t.dequantize() + 1)  # other ops in high precision
    y = torch.randn(4, 8, 64)
    t.quantize_(y)
    assert torch.equal(t.dequantize(), MXFP8Quantizer(E4M3)(y).dequantize())


def test_storage_internal_usage_and_errors():
    q = MXFP8Quantizer(E4M3)
    q.internal = True
    s = q(torch.randn(32, 64))
    assert type(s) is MXFP8TensorStorage and s.get_usages() == {"rowwise": True, "columnwise": True}
    s.update_usage(columnwise_usage=False)
    with pytest.raises(RuntimeError, match="quantize it again"):
        s.update_usage(columnwise_usage=True)
    with pytest.raises(NotImplementedError, match="with_gemm_swizzled_scales"):
        MXFP8TensorStorage(None, None, s._rowwise_data, s._rowwise_scale_inv, E4M3, None, True)
    with pytest.raises(TypeError, match="float64"):
        MXFP8Quantizer(E4M3)(torch.ones(2, 32, dtype=torch.float64))
    empty = MXFP8Quantizer(E4M3).make_empty((64, 96), device="cpu")
    assert tuple(empty._columnwise_scale_inv.shape) == (4, 128)
    tensors, obj = s.prepare_for_saving()
    assert obj.restore_from_saved(tensors) == []
    assert MXFP8Quantizer(E4M3).is_quantizable(torch.ones(64, 96))
    assert not MXFP8Quantizer(E4M3).is_quantizable(torch.ones(64, 70))


@needs_cuda
def test_cuda_cast_matches_cpu():
    x = _sample((128, 160), torch.bfloat16, seed=5)
    cpu = MXFP8Quantizer(E4M3)(x)
    gpu = MXFP8Quantizer(E4M3)(x.cuda())
    for name in (
        "_rowwise_data",
        "_rowwise_scale_inv",
        "_columnwise_data",
        "_columnwise_scale_inv",
    ):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name))
