"""Float8BlockQuantizer / Float8BlockwiseQTensor / the block-scaled GEMM / Float8BlockScaling.

The cast is held byte for byte to the float64 loop oracle of ``block_scaling_oracle``; scale
shapes to the GEMM_READY table of the specification; the emulated GEMM to a float64 product of
the oracle's dequantized operands.
"""

import math

import pytest
import torch
from block_scaling_oracle import BLOCK, oracle_cast, oracle_dequantize
from utils import needs_cuda, needs_two_gpus

from transformer_engine.common.recipe import Float8BlockScaling, Format, MMParams
from transformer_engine.pytorch.cpp_extensions.block_gemm import native_block_gemm_refusals
from transformer_engine.pytorch.cpp_extensions.gemm import general_gemm
from transformer_engine.pytorch.extra_state.recipe_dict import recipe_from_dict, recipe_to_dict
from transformer_engine.pytorch.quantization import RecipeState
from transformer_engine.pytorch.quantization.support import is_fp8_block_scaling_available
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
    Float8BlockQuantizer,
    Float8BlockwiseQTensor,
)
from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
    Float8BlockwiseQTensorStorage,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(256, 128), (130, 260), (1, 300), (0, 128), (2, 3, 130), (311,)]


def cdiv(a, b):
    return -(-a // b)


def rup(a, b):
    return cdiv(a, b) * b


def matrix_dims(shape):
    return (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)


def quantizer(dim, dtype=E4M3, pow2=True, eps=0.0):
    return Float8BlockQuantizer(
        dtype, rowwise=True, columnwise=True, block_scaling_dim=dim,
        force_pow_2_scales=pow2, amax_epsilon=eps,
    )  # fmt: skip


def fp8_values(data_uint8, dtype):
    return data_uint8.view(dtype).double()


def expected_scale_shapes(shape, dim):
    m, k = matrix_dims(shape)
    if dim == 1:
        return (cdiv(k, BLOCK), rup(m, 4)), (cdiv(m, BLOCK), rup(k, 4))
    return (cdiv(m, BLOCK), rup(cdiv(k, BLOCK), 4)), (cdiv(k, BLOCK), rup(cdiv(m, BLOCK), 4))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32"])
def test_cast_matches_oracle(shape, dim, dtype, pow2):
    torch.manual_seed(1)
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[-1] if shape else 1)
    t = quantizer(dim, dtype, pow2)(x)
    assert isinstance(t, Float8BlockwiseQTensor) and t._is_2D_scaled == (dim == 2)
    m, k = matrix_dims(shape)
    row_shape, col_shape = expected_scale_shapes(shape, dim)
    assert tuple(t._rowwise_scale_inv.shape) == row_shape
    assert tuple(t._columnwise_scale_inv.shape) == col_shape
    assert t._rowwise_data.dtype == torch.uint8 and tuple(t._rowwise_data.shape) == shape
    assert tuple(t._columnwise_data.shape) == ((shape[-1], *shape[:-1]) if shape else ())
    matrix = x.reshape(m, k)
    for columnwise, a in ((False, matrix), (True, matrix.t())):
        values, scales = oracle_cast(a, dtype, two_d=dim == 2, pow2=pow2)
        data = t._columnwise_data if columnwise else t._rowwise_data
        scale_inv = t._columnwise_scale_inv if columnwise else t._rowwise_scale_inv
        got = fp8_values(data, dtype).reshape(a.shape)
        assert torch.equal(got, values)
        for (bi, bj), s in scales.items():
            stored = scale_inv[bi, bj] if dim == 2 else scale_inv[bj, bi]
            assert float(stored) == float(torch.tensor(1.0 / s, dtype=torch.float32))
        if pow2:
            finite = scale_inv[scale_inv > 0]
            assert torch.equal(torch.log2(finite), torch.log2(finite).round())


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_dequantize_round_trip_bound(dim, dtype):
    # Per element: half an FP8 ulp of the scaled value (2^-4 relative for E4M3's 3 mantissa
    # bits, 2^-3 for E5M2), or half the smallest subnormal step in the subnormal range,
    # divided by the block's scale.
    torch.manual_seed(2)
    x = torch.randn(200, 300) * 10
    t = quantizer(dim, dtype)(x)
    rel, sub = (2.0**-4, 2.0**-10) if dtype == E4M3 else (2.0**-3, 2.0**-17)
    oracle = oracle_dequantize(x, dtype, two_d=dim == 2, pow2=True)
    for plain in (t.dequantize(), t.dequantize(dtype=torch.bfloat16).float()):
        assert plain.shape == x.shape
    got = t.dequantize().double()
    assert torch.equal(got, oracle)
    # The column-wise copy alone dequantizes to the same tensor within the same bound.
    s = t.detach()
    s._rowwise_data = s._rowwise_scale_inv = None
    max_scale_inv = float(max(t._rowwise_scale_inv.max(), t._columnwise_scale_inv.max()))
    bound = x.double().abs() * rel + sub * max_scale_inv
    for values in (got, s.dequantize().double()):
        assert bool(((values - x.double()).abs() <= bound).all())


def test_special_values():
    q = quantizer(1)
    x = torch.zeros(2, 256)
    x[0, 5] = float("nan")
    x[0, 6] = 3.0
    x[1, 130] = float("inf")
    t = q(x)
    rows = t._rowwise_data
    assert int(rows[0, 5]) == 0x7F  # canonical NaN
    assert float(t._rowwise_scale_inv[1, 0]) == 1.0  # all-zero tile: scale 1
    assert math.isinf(float(t._rowwise_scale_inv[1, 1]))  # inf amax: scale 0
    assert float(t._rowwise_scale_inv[0, 0]) == 2.0 ** math.ceil(math.log2(3.0 / 448))
    eps = quantizer(1, eps=1.0)(torch.full((1, 128), 0.25))
    assert float(eps._rowwise_scale_inv[0, 0]) == 2.0 ** math.ceil(math.log2(1.0 / 448))


def test_views_keep_blocks():
    x = torch.randn(2, 4, 256)
    one = quantizer(1)(x)
    assert isinstance(one.view(8, 256), Float8BlockwiseQTensor)
    assert torch.equal(one.view(8, 256).dequantize(), one.dequantize().view(8, 256))
    with pytest.raises(RuntimeError, match="last dim"):
        one.view(2, 1024)
    two = quantizer(2)(x)
    assert isinstance(two.view(2, 4, 256), Float8BlockwiseQTensor)
    with pytest.raises(RuntimeError, match="last two dims"):
        two.view(8, 256)
    storage = quantizer(1)
    storage.internal = True
    s = storage(x)
    assert isinstance(s, Float8BlockwiseQTensorStorage) and s.view((8, 256)).shape == (8, 256)


def test_usages():
    x = torch.randn(130, 256)
    q2 = quantizer(2)
    q2.set_usage(columnwise=False)
    t = q2(x)
    assert t._columnwise_data is None
    t.update_usage(columnwise_usage=True)
    full = quantizer(2)(x)
    assert torch.equal(t._columnwise_data, full._columnwise_data)
    assert torch.equal(t._columnwise_scale_inv, full._columnwise_scale_inv)
    q1 = quantizer(1)
    q1.set_usage(columnwise=False)
    with pytest.raises(RuntimeError, match="quantize again"):
        q1(x).update_usage(columnwise_usage=True)
    # In-place re-quantization and copies between tensors of the same kind.
    t2 = quantizer(1)(torch.zeros_like(x))
    t2.copy_(x)
    assert torch.equal(t2.dequantize(), quantizer(1)(x).dequantize())
    with pytest.raises(ValueError, match="must match"):
        t2.copy_from_storage(full)


def _gemm_operands():
    torch.manual_seed(3)
    x = torch.randn(96, 256)
    w = torch.randn(160, 256)
    dy = torch.randn(96, 160)
    return x, w, dy


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_emulated_gemm_equals_float64_product(out_dtype):
    x, w, dy = _gemm_operands()
    xq, wq, dyq = quantizer(1)(x), quantizer(2)(w), quantizer(1)(dy)

    def dq(a, two_d):
        return oracle_dequantize(a, E4M3, two_d=two_d, pow2=True)

    cases = {
        "TN": (wq, xq, dq(x, False) @ dq(w, True).t()),
        "NN": (wq, dyq, dq(dy, False) @ dq(w.t(), True).t()),
        "NT": (xq, dyq, dq(dy.t(), False) @ dq(x.t(), False).t()),
    }
    for layout, (a, b, ref) in cases.items():
        out = general_gemm(a, b, out_dtype, layout=layout)[0]
        assert out.dtype == out_dtype
        # float32 accumulation of exact products: K * 2^-24 relative to sum |a||b| at most.
        tol = 256 * 2.0**-24 * 4 if out_dtype == torch.float32 else 2.0**-8
        assert torch.allclose(out.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))
    bias = torch.randn(160)
    out = general_gemm(wq, xq, torch.float32, layout="TN", bias=bias)[0]
    ref = dq(x, False) @ dq(w, True).t() + bias.double()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="128x128"):
        general_gemm(wq, quantizer(2)(x), torch.float32, layout="TN")


def test_recipe_fields_and_validation(monkeypatch):
    r = Float8BlockScaling()
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    assert r.fp8_format is Format.E4M3 and r.float8_block_scaling()
    assert r.fp8_gemm_fprop == MMParams(True) and r.fp8_dpa is False
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert Float8BlockScaling().use_f32_scales is True
    with pytest.raises(ValueError, match="2D by 2D"):
        Float8BlockScaling(x_block_scaling_dim=2)
    with pytest.raises(ValueError, match="2D by 2D"):
        r.grad_block_scaling_dim = 2
    assert r.grad_block_scaling_dim == 1
    with pytest.raises(ValueError, match="1 .* or 2"):
        Float8BlockScaling(w_block_scaling_dim=3)
    with pytest.raises(ValueError, match="E5M2"):
        Float8BlockScaling(fp8_format=Format.E5M2)
    with pytest.raises(ValueError, match="use_split_accumulator"):
        Float8BlockScaling(fp8_gemm_wgrad=MMParams(False))
    with pytest.raises(ValueError, match="fp8_dpa"):
        Float8BlockScaling(fp8_dpa=True)
    assert recipe_from_dict(recipe_to_dict(r)) == r
    assert is_fp8_block_scaling_available(device="cpu")
    assert is_fp8_block_scaling_available(return_reason=True, device="cpu") == (True, "")


def test_recipe_state_quantizers():
    r = Float8BlockScaling(fp8_format=Format.HYBRID, use_f32_scales=True)
    fwd = RecipeState.create(r, mode="forward", num_quantizers=6, device="cpu").make_quantizers()
    bwd = RecipeState.create(r, mode="backward", num_quantizers=4, device="cpu").make_quantizers()
    assert [q.block_scaling_dim for q in fwd] == [1, 2, 1, 1, 2, 1]
    assert all(q.rowwise_usage and q.columnwise_usage for q in fwd + bwd)
    assert {q.dtype.name for q in fwd} == {"kFloat8E4M3"}
    assert {q.dtype.name for q in bwd} == {"kFloat8E5M2"}
    assert [q.block_scaling_dim for q in bwd] == [1] * 4
    assert not any(q.force_pow_2_scales for q in fwd + bwd)
    assert RecipeState.create(r, mode="forward", device="cpu").delayed_scaling_state() is None


@needs_cuda
@pytest.mark.parametrize("dim", [1, 2])
def test_cuda_cast_equals_cpu(dim):
    x = torch.randn(130, 300)
    cpu = quantizer(dim)(x)
    gpu = quantizer(dim)(x.to("cuda:0"))
    for name in (
        "_rowwise_data",
        "_rowwise_scale_inv",
        "_columnwise_data",
        "_columnwise_scale_inv",
    ):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name))


@pytest.mark.parametrize("columnwise", [False, True])
def test_native_scales_give_each_element_its_block_scale(columnwise):
    # The native kernel takes a 128x128 operand as a 1x128 one: element (r, c) of the matrix the
    # GEMM reads must get the scale of its 128x128 block, (r // 128, c // 128), from the oracle.
    from transformer_engine.pytorch.cpp_extensions.block_gemm import _scaled_mm_scales

    torch.manual_seed(5)
    w = torch.randn(300, 512) * torch.logspace(-3, 3, 300).unsqueeze(1)  # one scale per block row
    x = torch.randn(70, 300 if columnwise else 512)
    wq, xq = quantizer(2)(w), quantizer(1)(x)
    y_vals, y_scales, y2d = wq.block_float8_gemm_input(columnwise)
    x_vals, x_scales, x2d = xq.block_float8_gemm_input(False)
    assert y2d and not x2d
    scale_a, scale_b = _scaled_mm_scales(x_vals, x_scales, x2d, y_vals, y_scales, y2d)
    rows, k = y_vals.shape
    # the column-wise copy shares the row-wise blocks: block (i, j) of w is block (j, i) of w^T
    _, scales = oracle_cast(w.t() if columnwise else w, E4M3, two_d=True, pow2=True)
    for r in (0, 127, 128, rows - 1):
        for kb in range(k // BLOCK):
            assert float(scale_b[kb, r]) == 1.0 / scales[(r // BLOCK, kb)]
    # the 1x128 operand: [M, kb], M contiguous, one scale per (row, tile)
    assert scale_a.shape == (70, k // BLOCK) and scale_a.stride() == (1, 70)


@needs_cuda
@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_native_gemm_equals_emulation(layout):
    # On sm_90 every layout runs a blockwise kernel (cuBLASLt's through the native library, the
    # weight with its 128x128 scales; without it torch._scaled_mm's 1x128 by 1x128 one, the
    # weight's scales repeated along its rows), no refusal is recorded, and each product matches the float64 product of the dequantized operands within the tensor cores'
    # accumulation error: Hopper's FP8 MMA keeps about 14 significant bits while it sums one
    # 128-wide K block (the kernel promotes to float32 between blocks), measured on the H200 at
    # 1e-4 of the output's largest magnitude. The wrong-scale failure this guards against
    # (torch's 128x128 mode) is off by 40%.
    x, w, dy = (t.to("cuda:0") for t in _gemm_operands())
    x, w, dy = x[:, :256], torch.cat([w, w[:96]]), torch.cat([dy, dy[:, :96]], 1)  # N = 256
    xq, wq, dyq = quantizer(1)(x), quantizer(2)(w), quantizer(1)(dy)
    a, b = {"TN": (wq, xq), "NN": (wq, dyq), "NT": (xq, dyq)}[layout]
    native = general_gemm(a, b, torch.float32, layout=layout)[0]
    if layout == "TN":
        ref = xq.dequantize().double() @ wq.dequantize().double().t()
    elif layout == "NN":
        ref = dyq.dequantize().double() @ wq.dequantize().double()
    else:  # wgrad reads the column-wise copies (1x128 tiles along the tokens)
        dy_col = dyq._dequantize_layout(True, torch.float32).double()
        x_col = xq._dequantize_layout(True, torch.float32).double()
        ref = dy_col @ x_col.t()
    assert torch.allclose(native.double(), ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))
    if torch.cuda.get_device_capability(0)[0] == 9:
        assert not native_block_gemm_refusals()


@needs_cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_native_gemm_adds_the_bias_before_rounding(out_dtype):
    # fprop with a bias of the output dtype: the GEMM's epilogue adds a 16-bit one in float32
    # and rounds once (a float32 one is added to the float32 product), so the result is the float64 product + bias rounded to out_dtype, within the
    # accumulator's error (see above) and one rounding of the output; nothing is refused.
    x, w, _ = (t.to("cuda:0") for t in _gemm_operands())
    x, w = x[:, :256], torch.cat([w, w[:96]])  # N = 256
    bias = (torch.randn(256, device="cuda:0") * 8).to(out_dtype)
    xq, wq = quantizer(1)(x), quantizer(2)(w)
    got = general_gemm(wq, xq, out_dtype, layout="TN", bias=bias)[0]
    ref = xq.dequantize().double() @ wq.dequantize().double().t() + bias.double()
    ulp = 2.0**-8 if out_dtype == torch.bfloat16 else 0.0
    tol = 1e-3 * float(ref.abs().max())
    assert got.dtype == out_dtype
    assert torch.allclose(got.double(), ref, rtol=1e-3 + ulp, atol=tol)
    if torch.cuda.get_device_capability(0)[0] == 9:
        assert not native_block_gemm_refusals()


@needs_two_gpus
def test_second_gpu_while_first_is_current():
    x = torch.randn(64, 256, device="cuda:1")
    w = torch.randn(128, 256, device="cuda:1")
    with torch.cuda.device(0):
        xq, wq = quantizer(1)(x), quantizer(2)(w)
        out = general_gemm(wq, xq, torch.float32, layout="TN")[0]
        assert torch.cuda.current_device() == 0
    assert out.device == torch.device("cuda:1") and xq._rowwise_scale_inv.device == x.device
    ref = xq.dequantize().double() @ wq.dequantize().double().t()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-3)
