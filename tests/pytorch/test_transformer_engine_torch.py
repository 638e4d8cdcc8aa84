"""``transformer_engine_torch`` (upstream's ``tex``): each entry point against independent
expectations: hand-written tables and values, the per-element FP8 oracle of
``fp8_oracle.py``, and float64 PyTorch math. The CPU part runs everywhere; the GPU part at the
end checks the CUDA path and skips without a GPU. The last test builds the pure-Python wheel
and checks that it ships the package.
"""

from __future__ import annotations

import ctypes
import pickle
import shutil
import subprocess
import sys
import zipfile

import fp8_oracle as oracle
import pytest
import torch
from utils import REPO_ROOT, needs_cuda

import transformer_engine.pytorch as te
import transformer_engine_torch as tex
from transformer_engine.pytorch.tensor import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    Float8TensorStorage,
)

E4M3, E5M2 = tex.DType.kFloat8E4M3, tex.DType.kFloat8E5M2
# The oracle takes torch FP8 dtypes (oracle.E4M3 / oracle.E5M2): it reads other values by name,
# and an IntEnum member prints as its number.
FP32, BF16 = tex.DType.kFloat32, tex.DType.kBFloat16


def gemm(A, transA, B, transB, D=None, quantizer=None, output_dtype=None, bias=None,
         bias_type=None, grad=False, accumulate=False, **kwargs):  # fmt: skip
    """``tex.generic_gemm`` with upstream's positional order and the usual unused arguments."""
    return tex.generic_gemm(
        A, transA, B, transB, D, quantizer, output_dtype, bias, bias_type, False, None, grad,
        None, 0, accumulate, False, **kwargs,
    )  # fmt: skip


def delayed_quantizer(scale: float, fp8_dtype=E4M3) -> Float8Quantizer:
    return Float8Quantizer(torch.tensor([scale]), torch.zeros(1), fp8_dtype)


def fp8_bytes(t) -> torch.Tensor:
    return t._data.view(torch.uint8)


# --- enums and the metadata struct ---------------------------------------------------------------
def test_dtype_has_upstreams_members_and_values_and_is_the_packages_dtype():
    expected = {"kByte": 0, "kInt32": 2, "kFloat32": 4, "kFloat16": 5, "kBFloat16": 6,
                "kFloat8E4M3": 7, "kFloat8E5M2": 8, "kFloat4E2M1": 10}  # fmt: skip
    assert {m.name: int(m) for m in tex.DType} == expected
    assert tex.DType is te.DType
    assert tex.DType(7) == tex.DType.kFloat8E4M3 == 7
    assert pickle.loads(pickle.dumps(tex.DType.kFloat8E5M2)) is tex.DType.kFloat8E5M2


def test_fp8_tensor_slot_enums():
    assert {m.name: int(m) for m in tex.FP8FwdTensors} == {
        "GEMM1_INPUT": 0, "GEMM1_WEIGHT": 1, "GEMM1_OUTPUT": 2, "GEMM2_INPUT": 3,
        "GEMM2_WEIGHT": 4, "GEMM2_OUTPUT": 5, "GEMM3_INPUT": 6, "GEMM3_WEIGHT": 7,
        "GEMM3_OUTPUT": 8,
    }  # fmt: skip
    assert {m.name: int(m) for m in tex.FP8BwdTensors} == {
        "GRAD_OUTPUT1": 0, "GRAD_INPUT1": 1, "GRAD_OUTPUT2": 2, "GRAD_INPUT2": 3,
        "GRAD_OUTPUT3": 4, "GRAD_INPUT3": 5,
    }  # fmt: skip
    scale = torch.arange(9.0)
    assert float(scale[tex.FP8FwdTensors.GEMM2_WEIGHT]) == 4.0  # usable as an index


def test_fp8_tensor_meta_holds_its_three_tensors_and_nothing_else():
    meta = tex.FP8TensorMeta()
    assert (meta.scale, meta.scale_inv, meta.amax_history) == (None, None, None)
    scale = torch.ones(3)
    meta.scale, meta.scale_inv, meta.amax_history = scale, torch.ones(3), torch.zeros(4, 3)
    assert meta.scale is scale and tuple(meta.amax_history.shape) == (4, 3)
    with pytest.raises(AttributeError):
        meta.amax = torch.zeros(1)
    assert "amax_history=tensor(shape=(4, 3)" in repr(meta)


# --- quantize family ----------------------------------------------------------------------------
def test_quantize_with_current_scaling_matches_the_oracle():
    x = torch.randn(8, 32, requires_grad=True)
    out = tex.quantize(x, Float8CurrentScalingQuantizer(E4M3))
    scale = oracle.scale_from_amax(oracle.amax(x), oracle.E4M3)
    assert isinstance(out, Float8Tensor) and out.grad_fn is None
    assert torch.equal(fp8_bytes(out), oracle.cast_bytes(x, scale, oracle.E4M3))
    assert torch.equal(out._scale_inv.reshape(1), oracle.reciprocal(scale))


def test_quantize_with_delayed_scaling_accumulates_amax_into_the_quantizer():
    quantizer = delayed_quantizer(2.0, E5M2)
    x = torch.tensor([[1.5, -3.0], [0.25, 7.0]])
    out = tex.quantize(x, quantizer)
    assert torch.equal(fp8_bytes(out), oracle.cast_bytes(x, 2.0, oracle.E5M2))
    assert float(out._scale_inv) == 0.5 and float(quantizer.amax) == 7.0
    tex.quantize(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), quantizer)
    assert float(quantizer.amax) == 7.0  # max-accumulated, not overwritten
    tex.quantize(torch.tensor([[9.0, 0.0], [0.0, 0.0]]), quantizer)
    assert float(quantizer.amax) == 9.0


def test_quantize_into_output_and_the_noop_flag():
    quantizer = delayed_quantizer(1.0)
    first = torch.tensor([[1.0, 2.0], [4.0, 8.0]])
    out = tex.quantize(first, quantizer)
    second = torch.tensor([[0.5, 0.25], [16.0, -1.0]])
    assert tex.quantize(second, quantizer, out, torch.ones(1)) is out  # noop = 1: untouched
    assert torch.equal(fp8_bytes(out), oracle.cast_bytes(first, 1.0, oracle.E4M3))
    assert tex.quantize(second, quantizer, out, torch.zeros(1)) is out
    assert torch.equal(fp8_bytes(out), oracle.cast_bytes(second, 1.0, oracle.E4M3))
    assert tex.quantize(first, quantizer, output=out) is out
    assert torch.equal(fp8_bytes(out), oracle.cast_bytes(first, 1.0, oracle.E4M3))


def test_quantize_with_an_internal_quantizer_gives_storage():
    quantizer = delayed_quantizer(4.0)
    quantizer.internal = True
    out = tex.quantize(torch.ones(2, 16), quantizer)
    assert isinstance(out, Float8TensorStorage) and not isinstance(out, torch.Tensor)


def test_quantize_refuses_what_is_not_a_quantizer_or_a_quantized_output():
    with pytest.raises(TypeError, match="quantizer must be"):
        tex.quantize(torch.ones(2, 2), None)
    with pytest.raises(TypeError, match="output must be a quantized tensor"):
        tex.quantize(torch.ones(2, 2), delayed_quantizer(1.0), torch.empty(2, 2))


@pytest.mark.parametrize("otype, dtype", [(FP32, torch.float32), (BF16, torch.bfloat16),
                                          (tex.DType.kFloat16, torch.float16)])  # fmt: skip
def test_dequantize_gives_the_values_in_otype(otype, dtype):
    x = torch.tensor([[1.0, -2.0, 0.5, 448.0]])  # exact in E4M3 at scale 1
    q = tex.quantize(x, delayed_quantizer(1.0))
    out = tex.dequantize(q, otype)
    assert out.dtype == dtype and torch.equal(out, x.to(dtype)) and out.grad_fn is None
    scaled = tex.quantize(torch.tensor([[3.0, -0.1]]), delayed_quantizer(8.0))
    expected = oracle.dequantize(fp8_bytes(scaled), 0.125, torch.float32, oracle.E4M3)
    assert torch.equal(tex.dequantize(scaled, FP32), expected)


def test_dequantize_refuses_bad_arguments():
    q = tex.quantize(torch.ones(2, 2), delayed_quantizer(1.0))
    with pytest.raises(TypeError, match="otype"):
        tex.dequantize(q, E4M3)
    with pytest.raises(TypeError, match="input must be a quantized tensor"):
        tex.dequantize(torch.ones(2), FP32)


def test_bgrad_quantize_returns_the_bias_gradient_then_the_quantized_tensor():
    dy = torch.randn(5, 3, 16)
    grad_bias, q = tex.bgrad_quantize(dy, delayed_quantizer(2.0))
    torch.testing.assert_close(grad_bias, oracle.column_sum(dy), rtol=1e-6, atol=1e-6)
    assert torch.equal(fp8_bytes(q), oracle.cast_bytes(dy, 2.0, oracle.E4M3))


def test_create_empty_quantized_tensor():
    out = tex.create_empty_quantized_tensor(
        Float8CurrentScalingQuantizer(E4M3), [4, 16], torch.bfloat16, torch.device("cpu"), False
    )
    assert isinstance(out, Float8Tensor)
    assert tuple(out.shape) == (4, 16) and out.dtype == torch.bfloat16 and out.device.type == "cpu"


def test_multi_tensor_quantize():
    xs = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0], [5.0]])]
    outs = tex.multi_tensor_quantize(xs, [delayed_quantizer(1.0), delayed_quantizer(0.5)])
    assert torch.equal(fp8_bytes(outs[0]), oracle.cast_bytes(xs[0], 1.0, oracle.E4M3))
    assert torch.equal(fp8_bytes(outs[1]), oracle.cast_bytes(xs[1], 0.5, oracle.E4M3))
    with pytest.raises(ValueError, match="2 tensors but 1 quantizers"):
        tex.multi_tensor_quantize(xs, [delayed_quantizer(1.0)])


def test_compute_amax_overwrites():
    amax = torch.tensor([100.0])
    tex.compute_amax(torch.tensor([[1.0, -6.5], [2.0, 0.0]]), amax)
    assert float(amax) == 6.5


def test_fp8_transpose_moves_the_bytes():
    data = torch.arange(2 * 3 * 4, dtype=torch.uint8).reshape(2, 3, 4)
    expected = data.reshape(6, 4).t()  # [N, M] with M the leading dims' product
    got = tex.fp8_transpose(data, E4M3)
    assert got.is_contiguous() and torch.equal(got, expected)
    out = torch.empty(4, 6, dtype=torch.float8_e5m2)
    assert tex.fp8_transpose(data.view(torch.float8_e5m2), E5M2, out=out) is out
    assert torch.equal(out.view(torch.uint8), expected)
    with pytest.raises(TypeError, match="not an FP8 type"):
        tex.fp8_transpose(data, BF16)
    with pytest.raises(TypeError, match="pass the FP8 bytes"):
        tex.fp8_transpose(data.float(), E4M3)
    with pytest.raises(ValueError, match=r"expected \(4, 6\)"):
        tex.fp8_transpose(data, E4M3, out=torch.empty(6, 4, dtype=torch.uint8))


def test_get_num_cublas_streams_is_one_stream():
    assert tex.get_num_cublas_streams() == 1


# --- fused delayed-scaling update -----------------------------------------------------------------
def test_fused_amax_and_scale_update_after_reduction_matches_the_model():
    hist = [[[3.0, 0.0, 2.0], [1.0, 5.0, 0.5], [4.0, 2.0, 0.25]]]  # [L=3, N=3]
    scales = [[1.0, 1.0, 1.0]]
    reduced = [6.0, 0.0, 0.0]  # slot 0 reduced to 6; slot 1 has no amax anywhere; slot 2 keeps 2
    histories = [torch.tensor(hist[0])]
    scale_t = [torch.tensor(scales[0])]
    tex.fused_amax_and_scale_update_after_reduction(
        torch.tensor(reduced), histories, scale_t, "max", E4M3, 1.0
    )
    oracle.delayed_scaling_update_model(hist, scales, 448.0, margin=1.0, reduced=reduced)
    assert histories[0].tolist() == hist[0] and scale_t[0].tolist() == scales[0]
    # By hand: slot 0's amax is max(6, 1, 4) = 6 -> 224 / 6; slot 1 (no amax) keeps scale 1.
    assert scale_t[0][1] == 1.0 and scale_t[0][0] == torch.tensor(224.0 / 6.0)


# --- generic_gemm -------------------------------------------------------------------------------
def f64(t):
    return t.detach().double()


@pytest.mark.parametrize(
    "transA, transB, a_shape, b_shape, expected",
    [
        (True, False, (12, 8), (2, 5, 8), lambda a, b: b @ a.T),  # TN fprop: x W^T
        (False, False, (8, 12), (10, 8), lambda a, b: b @ a),  # NN dgrad: dy W
        (False, True, (10, 12), (10, 8), lambda a, b: b.T @ a),  # NT wgrad: dy^T x
    ],
    ids=["TN", "NN", "NT"],
)
def test_generic_gemm_high_precision_layouts(transA, transB, a_shape, b_shape, expected):
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    out, bias_grad, pre_gelu, extra = gemm(a, transA, b, transB, output_dtype=FP32)
    torch.testing.assert_close(f64(out), expected(f64(a), f64(b)), rtol=1e-5, atol=1e-5)
    assert (bias_grad, pre_gelu, extra) == (None, None, None)


def test_generic_gemm_bias_alpha_and_output_dtype():
    w, x, bias = torch.randn(6, 4), torch.randn(3, 4), torch.randn(6)
    out = gemm(w, True, x, False, output_dtype=BF16, bias=bias, alpha=2.0)[0]
    assert out.dtype == torch.bfloat16
    expected = 2.0 * f64(x) @ f64(w).T + f64(bias)
    torch.testing.assert_close(f64(out), expected, rtol=1e-2, atol=1e-2)


def test_generic_gemm_wgrad_bias_gradient():
    x, dy = torch.randn(10, 8), torch.randn(10, 6)
    out, bias_grad, _, _ = gemm(x, False, dy, True, output_dtype=FP32, bias=torch.zeros(6),
                                bias_type=BF16, grad=True)  # fmt: skip
    torch.testing.assert_close(f64(out), f64(dy).T @ f64(x), rtol=1e-5, atol=1e-5)  # no bias
    assert bias_grad.dtype == torch.bfloat16
    torch.testing.assert_close(f64(bias_grad), f64(dy).sum(0), rtol=1e-2, atol=1e-2)
    with pytest.raises(NotImplementedError, match="grad=True with a bias.*not TN"):
        gemm(torch.randn(6, 8), True, x, False, bias=torch.zeros(6), grad=True)


def test_generic_gemm_accumulate_and_beta():
    w, x = torch.randn(6, 4), torch.randn(3, 4)
    d0 = torch.randn(3, 6)
    product = f64(x) @ f64(w).T
    d = d0.clone()
    assert gemm(w, True, x, False, D=d, accumulate=True)[0] is d
    torch.testing.assert_close(f64(d), f64(d0) + product, rtol=1e-5, atol=1e-5)
    d = d0.clone()
    gemm(w, True, x, False, D=d, accumulate=True, beta=0.5)
    torch.testing.assert_close(f64(d), 0.5 * f64(d0) + product, rtol=1e-5, atol=1e-5)
    d = torch.full((3, 6), float("nan"))
    gemm(w, True, x, False, D=d, accumulate=True, beta=0.0)  # beta = 0: the old D is not read
    torch.testing.assert_close(f64(d), product, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="beta=0.5 .* accumulate=False"):
        gemm(w, True, x, False, D=d, beta=0.5)
    with pytest.raises(ValueError, match="D must be given"):
        gemm(w, True, x, False, accumulate=True)


def test_generic_gemm_fp8_operands_match_the_dequantized_product():
    quantizer = Float8CurrentScalingQuantizer(E4M3)
    w, x = torch.randn(32, 16), torch.randn(8, 16)
    wq, xq = tex.quantize(w, quantizer), tex.quantize(x, quantizer)
    out = gemm(wq, True, xq, False, output_dtype=FP32)[0]
    w_deq = oracle.dequantize(fp8_bytes(wq), wq._scale_inv, torch.float32, oracle.E4M3)
    x_deq = oracle.dequantize(fp8_bytes(xq), xq._scale_inv, torch.float32, oracle.E4M3)
    torch.testing.assert_close(f64(out), f64(x_deq) @ f64(w_deq).T, rtol=1e-5, atol=1e-5)
    assert gemm(wq, True, xq, False)[0].dtype == torch.bfloat16  # upstream's FP8 default


def test_generic_gemm_quantized_output():
    # Small integers: the product is exact in float32, so the expected bytes are exact too.
    w = torch.randint(-3, 4, (16, 16)).float()
    x = torch.randint(-3, 4, (4, 16)).float()
    product = x @ w.T
    quantizer = delayed_quantizer(2.0)
    out = gemm(w, True, x, False, quantizer=quantizer, output_dtype=BF16)[0]
    assert isinstance(out, Float8Tensor) and out.dtype == torch.bfloat16
    assert torch.equal(fp8_bytes(out), oracle.cast_bytes(product, 2.0, oracle.E4M3))
    assert float(quantizer.amax) == float(product.abs().max())
    current = Float8CurrentScalingQuantizer(E4M3)
    d = tex.create_empty_quantized_tensor(current, [4, 16], torch.float32, torch.device("cpu"))
    assert gemm(w, True, x, False, D=d, quantizer=current)[0] is d
    scale = oracle.scale_from_amax(oracle.amax(product), oracle.E4M3)
    assert torch.equal(fp8_bytes(d), oracle.cast_bytes(product, scale, oracle.E4M3))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"transA": True, "transB": True}, ValueError, "layout 'TT'"),
        ({"gelu": True}, NotImplementedError, "gelu=True"),
        ({"comm_overlap": object()}, NotImplementedError, "comm_overlap"),
        ({"extra_output": torch.empty(1)}, NotImplementedError, "extra_output"),
        ({"bulk_overlap": True}, NotImplementedError, "bulk_overlap"),
        ({"output_dtype": E4M3}, TypeError, "output_dtype.*quantizer is None"),
        ({"quantizer": "fp8"}, TypeError, "quantizer must be"),
        ({"D": "quantized"}, TypeError, "D is a quantized tensor"),
    ],
)
def test_generic_gemm_refuses_what_is_not_built_naming_the_argument(kwargs, error, match):
    args = dict(A=torch.randn(16, 16), transA=True, B=torch.randn(4, 16), transB=False, D=None,
                quantizer=None, output_dtype=None, bias=None, bias_type=None, gelu=False,
                gelu_in=None, grad=False, workspace=None, workspace_size=0, accumulate=False,
                use_split_accumulator=False)  # fmt: skip
    if kwargs.get("D") == "quantized":
        kwargs = {"D": tex.quantize(torch.ones(4, 16), delayed_quantizer(1.0))}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        tex.generic_gemm(**args)


# --- norms: layernorm_fwd / layernorm_bwd / rmsnorm_fwd / rmsnorm_bwd --------------------------
EPS = 1e-5


def norm_operands(dtype=torch.float32, device="cpu", shape=(3, 5, 32), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype).to(device)
    w = (torch.rand(shape[-1], generator=g) * 0.5 - 0.25).to(dtype).to(device)
    b = torch.randn(shape[-1], generator=g).to(dtype).to(device)
    dz = torch.randn(shape, generator=g).to(dtype).to(device)
    return x, w, b, dz


def norm64(x, w, b, zero_centered, rms=False):
    """LayerNorm (RMSNorm when ``rms``) written out in float64, differentiable:
    ``g = w (+ 1)``; ``y = (x - mean) / sqrt(var + eps) * g + b`` with the biased variance,
    or ``y = x / sqrt(mean(x^2) + eps) * g``."""
    g = w + 1 if zero_centered else w
    if rms:
        return x / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * g
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / (var + EPS).sqrt() * g + b


def norm_grads64(x, w, b, dz, zero_centered, rms=False):
    """``(dx, dw, db)`` by float64 autograd through :func:`norm64`."""
    x64, w64 = f64(x).requires_grad_(), f64(w).requires_grad_()
    b64 = None if rms else f64(b).requires_grad_()
    norm64(x64, w64, b64, zero_centered, rms).backward(f64(dz))
    return x64.grad, w64.grad, None if rms else b64.grad


NORM_TOL = {
    torch.float32: {"rtol": 2e-5, "atol": 2e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_layernorm_fwd_and_bwd_match_the_float64_formulas(dtype, zero_centered):
    x, w, b, dz = norm_operands(dtype)
    out, mu, rsigma = tex.layernorm_fwd(x, w, b, EPS, None, None, tex.DType.cast(dtype), 0,
                                        zero_centered)  # fmt: skip
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(f64(out), norm64(f64(x), f64(w), f64(b), zero_centered),
                               **NORM_TOL[dtype])  # fmt: skip
    rows = f64(x).reshape(15, 32)
    assert mu.dtype == rsigma.dtype == torch.float32 and mu.shape == rsigma.shape == (15,)
    torch.testing.assert_close(f64(mu), rows.mean(1), rtol=1e-6, atol=1e-6)
    var = (rows - rows.mean(1, keepdim=True)).pow(2).mean(1)
    torch.testing.assert_close(f64(rsigma), 1 / (var + EPS).sqrt(), rtol=1e-6, atol=0)

    dx, dgamma, dbeta = tex.layernorm_bwd(dz, x, mu, rsigma, w, 0, zero_centered)
    assert (dx.dtype, dgamma.dtype, dbeta.dtype) == (dtype, dtype, dtype)
    ex, ew, eb = norm_grads64(x, w, b, dz, zero_centered)
    tol = NORM_TOL[dtype]
    torch.testing.assert_close(f64(dx), ex, rtol=tol["rtol"], atol=tol["atol"] * 10)
    torch.testing.assert_close(f64(dgamma), ew, rtol=tol["rtol"], atol=tol["atol"] * 30)
    torch.testing.assert_close(f64(dbeta), eb, rtol=tol["rtol"], atol=tol["atol"] * 30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rmsnorm_fwd_and_bwd_match_the_float64_formulas(dtype, zero_centered):
    x, w, _, dz = norm_operands(dtype)
    out, mu, rsigma = tex.rmsnorm_fwd(x, w, EPS, None, None, tex.DType.cast(dtype), 0,
                                      zero_centered)  # fmt: skip
    assert mu is None and out.dtype == dtype
    torch.testing.assert_close(f64(out), norm64(f64(x), f64(w), None, zero_centered, rms=True),
                               **NORM_TOL[dtype])  # fmt: skip
    rows = f64(x).reshape(15, 32)
    torch.testing.assert_close(f64(rsigma), 1 / (rows.pow(2).mean(1) + EPS).sqrt(), rtol=1e-6,
                               atol=0)  # fmt: skip
    dx, dgamma = tex.rmsnorm_bwd(dz, x, rsigma, w, 0, zero_centered)
    assert (dx.dtype, dgamma.dtype) == (dtype, dtype)
    ex, ew, _ = norm_grads64(x, w, None, dz, zero_centered, rms=True)
    tol = NORM_TOL[dtype]
    torch.testing.assert_close(f64(dx), ex, rtol=tol["rtol"], atol=tol["atol"] * 10)
    torch.testing.assert_close(f64(dgamma), ew, rtol=tol["rtol"], atol=tol["atol"] * 30)


def test_norms_record_nothing_on_the_autograd_tape():
    x, w, b, dz = (t.requires_grad_() for t in norm_operands())
    results = [*tex.layernorm_fwd(x, w, b, EPS, None, None, FP32, 0, False)]
    results += tex.rmsnorm_fwd(x, w, EPS, None, None, FP32, 0, True)[::2]
    _, mu, rsigma = results[:3]
    results += tex.layernorm_bwd(dz, x, mu, rsigma, w, 0, False)
    results += tex.rmsnorm_bwd(dz, x, rsigma, w, 0, True)
    assert all(t.grad_fn is None and not t.requires_grad for t in results)


def norm32_from_stats(x, w, b, mu, rsigma):
    """The float32 LayerNorm output rebuilt from the returned statistics, in the order a
    norm-then-cast kernel rounds: ``(x - mu) * rsigma * w + b``."""
    rows = x.float().reshape(-1, x.shape[-1])
    return ((rows - mu[:, None]) * rsigma[:, None] * w.float() + b.float()).reshape(x.shape)


def test_layernorm_fwd_with_a_delayed_scaling_quantizer_gives_fp8_of_the_float32_values():
    x, w, b, _ = norm_operands(torch.bfloat16)
    quantizer = delayed_quantizer(16.0)
    out, mu, rsigma = tex.layernorm_fwd(x, w, b, EPS, None, quantizer, BF16, 0, False)
    y32 = norm32_from_stats(x, w, b, mu, rsigma)
    assert isinstance(out, Float8Tensor) and out.dtype == torch.bfloat16  # otype: nominal type
    assert torch.equal(fp8_bytes(out), oracle.cast_bytes(y32, 16.0, oracle.E4M3))
    assert float(out._scale_inv) == 1 / 16 and float(quantizer.amax) == float(oracle.amax(y32))


def test_rmsnorm_fwd_with_a_current_scaling_quantizer_into_ln_out():
    x, w, _, _ = norm_operands(torch.float32)
    quantizer = Float8CurrentScalingQuantizer(E4M3)
    ln_out = tex.create_empty_quantized_tensor(quantizer, x.shape, torch.float32, "cpu")
    out, _, rsigma = tex.rmsnorm_fwd(x, w, EPS, ln_out, quantizer, FP32, 0, True)
    assert out is ln_out
    y32 = (x.reshape(-1, 32) * rsigma[:, None] * (w + 1)).reshape(x.shape)
    scale = oracle.scale_from_amax(oracle.amax(y32), oracle.E4M3)
    assert torch.equal(fp8_bytes(out), oracle.cast_bytes(y32, scale, oracle.E4M3))
    assert torch.equal(out._scale_inv.reshape(1), oracle.reciprocal(scale))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, w: tex.layernorm_fwd(x, w, None, EPS, None, None, E4M3, 0, False), "otype"),
        (lambda x, w: tex.rmsnorm_fwd(x, w, EPS, None, "fp8", FP32, 0, False), "quantizer"),
        (lambda x, w: tex.rmsnorm_fwd(x, w[:4], EPS, None, None, FP32, 0, False), "weight"),
        (lambda x, w: tex.layernorm_bwd(x, x, torch.ones(4), torch.ones(3), w, 0, False),
         "rsigma has 3"),
        (lambda x, w: tex.rmsnorm_bwd(x, x, torch.ones(4), w, 0, None), "zero_centered_gamma"),
    ],
)  # fmt: skip
def test_norm_refusals_name_the_argument(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call(torch.randn(4, 8), torch.ones(8))


# --- version queries ----------------------------------------------------------------------------
def test_get_cublaslt_version_without_cuda_says_why(monkeypatch):
    tex.get_cublasLt_version.cache_clear()
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(RuntimeError, match=r"torch.version.cuda is None"):
        tex.get_cublasLt_version()
    tex.get_cublasLt_version.cache_clear()


def test_get_cublaslt_version_names_what_it_tried(monkeypatch):
    tex.get_cublasLt_version.cache_clear()
    monkeypatch.setattr(torch.version, "cuda", "12.4")

    def no_library(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    with pytest.raises(RuntimeError, match=r"CUDA 12.4; tried libcublasLt\.so\.12"):
        tex.get_cublasLt_version()
    tex.get_cublasLt_version.cache_clear()


def test_get_cudnn_version_without_cudnn_says_why(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: None)
    with pytest.raises(RuntimeError, match="no cuDNN"):
        tex.get_cudnn_version()


# --- GPU ----------------------------------------------------------------------------------------
@needs_cuda
def test_cuda_quantize_and_dequantize_match_the_oracle():
    x = torch.randn(16, 32, device="cuda")
    out = tex.quantize(x, Float8CurrentScalingQuantizer(E4M3))
    scale = oracle.scale_from_amax(oracle.amax(x), oracle.E4M3)
    assert out.device == x.device
    assert torch.equal(fp8_bytes(out).cpu(), oracle.cast_bytes(x.cpu(), scale, oracle.E4M3))
    expected = oracle.dequantize(fp8_bytes(out), out._scale_inv, torch.float32, oracle.E4M3)
    assert torch.equal(tex.dequantize(out, FP32).cpu(), expected)


@needs_cuda
def test_cuda_generic_gemm_fp8_and_bias_gradient():
    quantizer = Float8CurrentScalingQuantizer(E4M3)
    w, x = torch.randn(32, 16, device="cuda"), torch.randn(64, 16, device="cuda")
    wq, xq = tex.quantize(w, quantizer), tex.quantize(x, quantizer)
    out = gemm(wq, True, xq, False, output_dtype=FP32)[0]
    w_deq = oracle.dequantize(fp8_bytes(wq), wq._scale_inv, torch.float32, oracle.E4M3)
    x_deq = oracle.dequantize(fp8_bytes(xq), xq._scale_inv, torch.float32, oracle.E4M3)
    torch.testing.assert_close(f64(out).cpu(), f64(x_deq) @ f64(w_deq).T, rtol=1e-3, atol=1e-3)
    dy = torch.randn(64, 32, device="cuda")
    _, bias_grad, _, _ = gemm(x, False, dy, True, output_dtype=FP32, bias=torch.zeros(32,
                              device="cuda"), grad=True)  # fmt: skip
    torch.testing.assert_close(f64(bias_grad).cpu(), f64(dy).sum(0).cpu(), rtol=1e-4, atol=1e-4)


@needs_cuda
def test_cuda_versions_are_upstreams_raw_integers():
    version = tex.get_cublasLt_version()
    assert isinstance(version, int)
    assert version // 10000 == int(torch.version.cuda.split(".")[0])  # 120103 = 12.1.3
    assert tex.get_cudnn_version() == torch.backends.cudnn.version()


@needs_cuda
@pytest.mark.parametrize("zero_centered", [False, True])
def test_cuda_norms_match_the_float64_formulas(zero_centered):
    x, w, b, dz = norm_operands(torch.bfloat16, "cuda")
    out, mu, rsigma = tex.layernorm_fwd(x, w, b, EPS, None, None, BF16, 0, zero_centered)
    assert out.device == x.device
    tol = NORM_TOL[torch.bfloat16]
    torch.testing.assert_close(f64(out), norm64(f64(x), f64(w), f64(b), zero_centered), **tol)
    dx, dgamma, dbeta = tex.layernorm_bwd(dz, x, mu, rsigma, w, 0, zero_centered)
    ex, ew, eb = norm_grads64(x, w, b, dz, zero_centered)
    torch.testing.assert_close(f64(dx), ex, rtol=tol["rtol"], atol=tol["atol"] * 10)
    torch.testing.assert_close(f64(dgamma), ew, rtol=tol["rtol"], atol=tol["atol"] * 30)
    torch.testing.assert_close(f64(dbeta), eb, rtol=tol["rtol"], atol=tol["atol"] * 30)
    out, _, rsigma = tex.rmsnorm_fwd(x, w, EPS, None, None, BF16, 0, zero_centered)
    torch.testing.assert_close(f64(out), norm64(f64(x), f64(w), None, zero_centered, True), **tol)
    dx, dgamma = tex.rmsnorm_bwd(dz, x, rsigma, w, 0, zero_centered)
    ex, ew, _ = norm_grads64(x, w, None, dz, zero_centered, rms=True)
    torch.testing.assert_close(f64(dx), ex, rtol=tol["rtol"], atol=tol["atol"] * 10)
    torch.testing.assert_close(f64(dgamma), ew, rtol=tol["rtol"], atol=tol["atol"] * 30)


@needs_cuda
def test_cuda_layernorm_fwd_quantized_output():
    x, w, b, _ = norm_operands(torch.bfloat16, "cuda")
    quantizer = Float8Quantizer(torch.tensor([16.0], device="cuda"),
                                torch.zeros(1, device="cuda"), E4M3)  # fmt: skip
    out, mu, rsigma = tex.layernorm_fwd(x, w, b, EPS, None, quantizer, BF16, 0, False)
    y32 = norm32_from_stats(x, w, b, mu, rsigma).cpu()
    assert out.device == x.device
    assert torch.equal(fp8_bytes(out).cpu(), oracle.cast_bytes(y32, 16.0, oracle.E4M3))


# --- packaging ----------------------------------------------------------------------------------
def test_pure_python_wheel_ships_the_package(tmp_path):
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for name in ("transformer_engine", "transformer_engine_torch", "build_tools"):
        shutil.copytree(REPO_ROOT / name, src / name, ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO_ROOT / name, src / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path / "dist")],
        env={**__import__("os").environ, "NVTE_BUILD_NATIVE": "0"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        "__init__",
        "_enums",
        "_quantize",
        "_gemm",
        "_versions",
        "_dtype_args",
        "_normalization",
    ):
        assert f"transformer_engine_torch/{module}.py" in names
    assert "transformer_engine/pytorch/__init__.py" in names
