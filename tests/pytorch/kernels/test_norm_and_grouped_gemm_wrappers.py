"""Upstream's norm entry points (layernorm_fwd/bwd, rmsnorm_fwd/bwd) and general_grouped_gemm.

Oracles: torch.nn.functional.layer_norm / rms_norm and torch.autograd in float64 for the norms,
the FP8 oracle (fake_quant) for the quantized norm output, float64 autograd for the backward
formulas on their own (normalization.*_backward_from_stats), per-group float64 matmuls for the
grouped GEMM.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close_by_table
from utils import fake_quant, needs_cuda

from transformer_engine.pytorch import cpp_extensions as ce
from transformer_engine.pytorch.constants import DType
from transformer_engine.pytorch.cpp_extensions import normalization
from transformer_engine.pytorch.tensor import Float8Quantizer

DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
EPS = 1e-5
# float32 compute against float64; outputs rounded once to the output dtype.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


def _operands(dtype, device, shape=(3, 5, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype).to(device)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).to(device)
    b = torch.randn(shape[-1], generator=g).to(dtype).to(device)
    dz = torch.randn(shape, generator=g).to(dtype).to(device)
    return x, w, b, dz


def _ln64(x, w, b, zero_centered):
    w = w.double() + 1 if zero_centered else w.double()
    return F.layer_norm(x.double(), (x.shape[-1],), w, b.double(), EPS)


def _rms64(x, w, zero_centered):
    w = w.double() + 1 if zero_centered else w.double()
    return F.rms_norm(x.double(), (x.shape[-1],), w, EPS)


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_layernorm_fwd_matches_float64(device, dtype, zero_centered):
    x, w, b, _ = _operands(dtype, device)
    out, mu, rsigma = ce.layernorm_fwd(
        x, w, b, EPS, None, None, DType.cast(dtype), 0, zero_centered
    )
    assert out.dtype == dtype and out.shape == x.shape and out.device == x.device
    torch.testing.assert_close(out.double(), _ln64(x, w, b, zero_centered), **_tol(dtype))
    x64 = x.double().reshape(-1, x.shape[-1])
    assert mu.dtype == torch.float32 and mu.shape == (15,)
    assert rsigma.dtype == torch.float32 and rsigma.shape == (15,)
    torch.testing.assert_close(mu.double(), x64.mean(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        rsigma.double(), 1 / (x64.var(1, unbiased=False) + EPS).sqrt(), rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rmsnorm_fwd_matches_float64(device, dtype, zero_centered):
    x, w, _, _ = _operands(dtype, device)
    out, mu, rsigma = ce.rmsnorm_fwd(x, w, EPS, None, None, dtype, 0, zero_centered)
    assert mu is None and out.dtype == dtype
    torch.testing.assert_close(out.double(), _rms64(x, w, zero_centered), **_tol(dtype))
    x64 = x.double().reshape(-1, x.shape[-1])
    torch.testing.assert_close(
        rsigma.double(), 1 / (x64.square().mean(1) + EPS).sqrt(), rtol=1e-6, atol=0
    )


def _tol(dtype):
    rtol, atol = TOL[dtype]
    return {"rtol": rtol, "atol": atol}


def test_layernorm_fwd_without_bias_and_other_otype():
    x, w, _, _ = _operands(torch.bfloat16, "cpu")
    out, _, _ = ce.layernorm_fwd(x, w, None, EPS, None, None, DType.kFloat32, 0, False)
    assert out.dtype == torch.float32  # otype, not the input's dtype
    ref = F.layer_norm(x.double(), (64,), w.double(), None, EPS)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_forward_writes_ln_out_and_accepts_sm_margin():
    x, w, b, _ = _operands(torch.float32, "cpu")
    buf = torch.empty_like(x)
    out, _, _ = ce.layernorm_fwd(x, w, b, EPS, buf, None, int(DType.kFloat32), 16, False)
    assert out is buf
    torch.testing.assert_close(buf.double(), _ln64(x, w, b, False), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_quantizes_the_float32_output(device):
    x, w, b, _ = _operands(torch.bfloat16, device)
    scale = torch.tensor([8.0], device=device)
    quantizer = Float8Quantizer(scale, torch.zeros(1, device=device), torch.float8_e4m3fn)
    out, mu, rsigma = ce.layernorm_fwd(x, w, b, EPS, None, quantizer, DType.kBFloat16, 0, False)
    # Oracle: the float32 norm (from the returned statistics), cast by the FP8 oracle.
    x32 = x.float().reshape(-1, 64)
    y32 = ((x32 - mu[:, None]) * rsigma[:, None] * w.float() + b.float()).reshape(x.shape)
    expected = fake_quant(y32.cpu(), 8.0, torch.float8_e4m3fn)
    assert torch.equal(out.dequantize(dtype=torch.float32).double().cpu(), expected)
    assert out.dequantize().dtype == torch.bfloat16  # otype is the nominal type
    assert quantizer.amax.item() == y32.abs().max().item()  # amax of the float32 values


# ---------------------------------------------------------------- backward


def _autograd64(norm, dz, x, w, b, zero_centered):
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = b.double().requires_grad_() if b is not None else None
    gamma = w64 + 1 if zero_centered else w64
    if norm == "layernorm":
        y = F.layer_norm(x64, (x.shape[-1],), gamma, b64, EPS)
    else:
        y = F.rms_norm(x64, (x.shape[-1],), gamma, EPS)
    y.backward(dz.double())
    return x64.grad, w64.grad, (b64.grad if b64 is not None else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_layernorm_bwd_matches_float64_autograd(device, dtype, zero_centered):
    x, w, b, dz = _operands(dtype, device)
    _, mu, rsigma = ce.layernorm_fwd(x, w, b, EPS, None, None, dtype, 0, zero_centered)
    dx, dgamma, dbeta = ce.layernorm_bwd(dz, x, mu, rsigma, w, 0, zero_centered)
    assert (dx.dtype, dgamma.dtype, dbeta.dtype) == (dtype, dtype, dtype)
    ex, ew, eb = _autograd64("layernorm", dz, x, w, b, zero_centered)
    # Sums over 15 rows: scale the tolerance with the gradient's size.
    tol = _tol(dtype)
    torch.testing.assert_close(dx.double(), ex, rtol=tol["rtol"], atol=tol["atol"] * 10)
    torch.testing.assert_close(dgamma.double(), ew, rtol=tol["rtol"], atol=tol["atol"] * 30)
    torch.testing.assert_close(dbeta.double(), eb, rtol=tol["rtol"], atol=tol["atol"] * 30)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rmsnorm_bwd_matches_float64_autograd(device, zero_centered):
    x, w, _, dz = _operands(torch.float32, device)
    _, _, rsigma = ce.rmsnorm_fwd(x, w, EPS, None, None, torch.float32, 0, zero_centered)
    dx, dgamma = ce.rmsnorm_bwd(dz, x, rsigma, w, 0, zero_centered)
    ex, ew, _ = _autograd64("rmsnorm", dz, x, w, None, zero_centered)
    torch.testing.assert_close(dx.double(), ex, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dgamma.double(), ew, rtol=1e-5, atol=1e-4)


def test_layernorm_bwd_hand_formula_on_one_row():
    # One row [1, 3] with gamma = 1: xhat = (x - mu) * r; dx = r * (dz - mean(dz) - xhat *
    # mean(dz * xhat)), dgamma = dz * xhat, dbeta = dz.
    x = torch.tensor([[1.0, 2.0, 6.0]])
    w = torch.ones(3)
    dz = torch.tensor([[1.0, 0.0, -1.0]])
    mu = torch.tensor([3.0])
    r = torch.tensor([1 / (14 / 3 + EPS) ** 0.5])
    dx, dgamma, dbeta = ce.layernorm_bwd(dz, x, mu, r, w, 0, False)
    xhat = (x - 3.0) * r
    expected_dx = r * (dz - dz.mean() - xhat * (dz * xhat).mean())
    torch.testing.assert_close(dx, expected_dx)
    torch.testing.assert_close(dgamma, (dz * xhat)[0])
    torch.testing.assert_close(dbeta, dz[0])


# The backward formulas on their own (normalization.*_backward_from_stats): any normalized
# shape, the statistics' dtype as the compute dtype, gradients computed only when asked for.


def _stats(x, dims, rms=False):
    """Hand-written statistics, shaped to broadcast against x, in x's dtype."""
    mean = None if rms else x.mean(dim=dims, keepdim=True)
    centered = x if rms else x - mean
    return mean, torch.rsqrt(centered.square().mean(dim=dims, keepdim=True) + EPS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stats_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("normalized", [(16,), (4, 16)])
def test_backward_from_stats_matches_float64_autograd(device, stats_dtype, normalized):
    x, w, b, dz = _operands(torch.bfloat16, device, shape=(3, 4, 16))
    w = (torch.rand(normalized, generator=torch.Generator().manual_seed(3)) + 0.5).to(device)
    b = torch.randn(normalized, generator=torch.Generator().manual_seed(4)).to(device)
    dims = tuple(range(-len(normalized), 0))
    xs = x.to(stats_dtype)
    mean, rstd = _stats(xs, dims)
    dx, dgamma, dbeta = normalization.layernorm_backward_from_stats(dz, x, mean, rstd, w)
    assert {dx.dtype, dgamma.dtype, dbeta.dtype} == {stats_dtype}
    assert dx.shape == x.shape and dgamma.shape == dbeta.shape == normalized
    x64 = x.double().requires_grad_()
    w64, b64 = w.double().requires_grad_(), b.double().requires_grad_()
    F.layer_norm(x64, normalized, w64, b64, EPS).backward(dz.double())
    # The inputs are BF16 values, exact in both compute dtypes: only the compute rounds.
    tol = (
        {"rtol": 1e-5, "atol": 1e-4}
        if stats_dtype == torch.float32
        else {"rtol": 1e-9, "atol": 1e-9}
    )
    torch.testing.assert_close(dx.double(), x64.grad, **tol)
    torch.testing.assert_close(dgamma.double(), w64.grad, **tol)
    torch.testing.assert_close(dbeta.double(), b64.grad, **tol)

    _, rstd = _stats(xs, dims, rms=True)
    dx, dgamma = normalization.rmsnorm_backward_from_stats(dz, x, rstd, w)
    x64.grad = w64.grad = None
    F.rms_norm(x64, normalized, w64, EPS).backward(dz.double())
    torch.testing.assert_close(dx.double(), x64.grad, **tol)
    torch.testing.assert_close(dgamma.double(), w64.grad, **tol)


def test_backward_from_stats_computes_only_what_is_asked():
    x, w, _, dz = _operands(torch.float32, "cpu", shape=(5, 8))
    mean, rstd = _stats(x, (-1,))
    dx, dgamma, dbeta = normalization.layernorm_backward_from_stats(
        dz, x, mean, rstd, w, need_dx=False, need_dbeta=False
    )
    assert dx is None and dbeta is None
    torch.testing.assert_close(dgamma, (dz * (x - mean) * rstd).sum(0))
    dx, dgamma = normalization.rmsnorm_backward_from_stats(dz, x, rstd, w, need_dgamma=False)
    assert dgamma is None and dx.shape == x.shape
    # A single row with no row dimensions: dgamma is the per-feature product itself.
    _, dgamma, dbeta = normalization.layernorm_backward_from_stats(dz[0], x[0], mean[0], rstd[0], w)
    torch.testing.assert_close(dbeta, dz[0])
    torch.testing.assert_close(dgamma, dz[0] * (x[0] - mean[0]) * rstd[0])


def test_backward_from_stats_refuses_a_gamma_that_is_not_the_trailing_shape():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"gamma has shape \(4,\)"):
        normalization.rmsnorm_backward_from_stats(x, x, torch.ones(4, 1), torch.ones(4))


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda x, w: ce.layernorm_fwd(
                x, w[:3], None, EPS, None, None, DType.kFloat32, 0, False
            ),
            r"weight has shape \(3,\)",
        ),
        (
            lambda x, w: ce.layernorm_fwd(x, w, None, -1.0, None, None, DType.kFloat32, 0, False),
            "eps",
        ),
        (lambda x, w: ce.rmsnorm_fwd(x, w, EPS, None, None, DType.kFloat8E4M3, 0, False), "otype"),
        (
            lambda x, w: ce.rmsnorm_fwd(x, w, EPS, None, None, DType.kFloat32, -1, False),
            "sm_margin",
        ),
        (lambda x, w: ce.rmsnorm_fwd(x, w, EPS, None, None, DType.kFloat32, 0, 1), "zero_cent"),
        (
            lambda x, w: ce.rmsnorm_fwd(x, w, EPS, None, object(), DType.kFloat32, 0, False),
            "quantizer",
        ),
        (
            lambda x, w: ce.rmsnorm_fwd(x, w, EPS, torch.empty(2), None, DType.kFloat32, 0, False),
            "ln_out",
        ),
        (lambda x, w: ce.rmsnorm_bwd(x, x, torch.ones(2), w, 0, False), "rsigma has 2"),
        (
            lambda x, w: ce.layernorm_bwd(
                x, x, torch.ones(4, dtype=torch.float64), torch.ones(4), w, 0, False
            ),
            "mu has dtype",
        ),
        (lambda x, w: ce.rmsnorm_bwd(x[:2], x, torch.ones(4), w, 0, False), "dz has shape"),
    ],
)
def test_norm_bad_arguments_are_named(call, match):
    x, w = torch.randn(4, 8), torch.ones(8)
    with pytest.raises((TypeError, ValueError), match=match):
        call(x, w)


# ---------------------------------------------------------------- grouped GEMM


def _groups(layout, splits, k=32, n=16, dtype=torch.float32, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    if layout == "TN":  # A = W [n, k], B = x [m, k]
        return [rand(n, k) for _ in splits], [rand(m, k) for m in splits]
    if layout == "NN":  # A = W [n, k], B = dy [m, n]
        return [rand(n, k) for _ in splits], [rand(m, n) for m in splits]
    return [rand(m, k) for m in splits], [rand(m, n) for m in splits]  # NT: A = x, B = dy


def _expected(layout, a, b):
    a, b = a.double(), b.double()
    if layout == "TN":
        return b @ a.T
    return b @ a if layout == "NN" else b.T @ a


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_grouped_gemm_matches_per_group_matmuls(device, layout):
    splits = [3, 0, 7]
    A, B = _groups(layout, splits, device=device)
    out = [torch.empty(_expected(layout, a, b).shape, device=device) for a, b in zip(A, B)]
    result, bias, gelu_in = ce.general_grouped_gemm(
        A, B, out, [None] * 3, torch.float32, layout=layout, m_splits=splits
    )
    assert result is out and bias == [None] * 3 and gelu_in == [None] * 3
    for a, b, o in zip(A, B, out):
        torch.testing.assert_close(o.double(), _expected(layout, a, b), rtol=1e-5, atol=1e-5)


def test_grouped_gemm_single_output_bias_and_bf16():
    splits = [4, 2, 5]
    A, B = _groups("TN", splits, dtype=torch.bfloat16)
    biases = [torch.randn(16).to(torch.bfloat16) for _ in splits]
    out = torch.full((11, 16), float("nan"), dtype=torch.bfloat16)
    ce.general_grouped_gemm(
        A,
        B,
        [out],
        None,
        torch.bfloat16,
        m_splits=splits,
        bias=biases,
        use_bias=True,
        single_output=True,
    )
    rows = torch.split(out, splits)
    for a, b, bias, o in zip(A, B, biases, rows):
        expected = (_expected("TN", a, b) + bias.double()).to(torch.bfloat16)
        torch.testing.assert_close(o, expected, rtol=1.6e-2, atol=1e-2)


def test_grouped_gemm_bias_ignored_without_use_bias():
    A, B = _groups("TN", [3])
    out, _, _ = ce.general_grouped_gemm(
        A, B, [None], None, torch.float32, bias=[torch.full((16,), 100.0)]
    )
    torch.testing.assert_close(out[0].double(), _expected("TN", A[0], B[0]), rtol=1e-5, atol=1e-5)


def test_grouped_gemm_accumulate_and_grad_bias():
    splits = [5, 3]
    A, B = _groups("NT", splits)
    start = [torch.randn(16, 32) for _ in splits]
    out = [s.clone() for s in start]
    _, grad_bias, _ = ce.general_grouped_gemm(
        A,
        B,
        out,
        None,
        torch.float32,
        layout="NT",
        accumulate=True,
        grad=True,
        use_bias=True,
        bias=[None, None],
    )
    for a, b, s, o, db in zip(A, B, start, out, grad_bias):
        torch.testing.assert_close(
            o.double(), s.double() + _expected("NT", a, b), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(db.double(), b.double().sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_gemm_fp8_groups(device):
    # FP8 x FP8 per group, against the float64 product of what the GEMM sees (FP8 oracle).
    splits = [16, 32]
    A, B = _groups("TN", splits, k=32, n=16, device=device)
    qa, qb = [], []
    for a, b in zip(A, B):
        qa.append(
            Float8Quantizer(
                torch.tensor([4.0], device=device),
                torch.zeros(1, device=device),
                torch.float8_e4m3fn,
            )(a)
        )
        qb.append(
            Float8Quantizer(
                torch.tensor([2.0], device=device),
                torch.zeros(1, device=device),
                torch.float8_e4m3fn,
            )(b)
        )
    out, _, _ = ce.general_grouped_gemm(
        qa, qb, [None, None], None, torch.float32, use_split_accumulator=True
    )
    for a, b, o in zip(A, B, out):
        seen_a = fake_quant(a.cpu(), 4.0, torch.float8_e4m3fn)
        seen_b = fake_quant(b.cpu(), 2.0, torch.float8_e4m3fn)
        # The table's FP8 row: Hopper's FP8 tensor cores accumulate in reduced precision, so
        # the GPU product differs from the float64 one beyond float32 rounding (the CPU's
        # does not, and passes the same row).
        assert_close_by_table(o.cpu(), seen_b @ seen_a.T, ("fp8_dequantized", torch.float32))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"gelu": True}, NotImplementedError, "gelu"),
        ({"D_dtype": DType.kFloat8E4M3}, NotImplementedError, "D_dtype"),
        (
            {"quantization_params": [None, object()]},
            NotImplementedError,
            r"quantization_params\[1\]",
        ),
        ({"m_splits": [3, 4]}, ValueError, r"m_splits\[1\]=4"),
        ({"single_output": True}, ValueError, "m_splits"),
        ({"layout": "NT", "single_output": True, "m_splits": [3, 5]}, ValueError, "layout"),
        ({"out": [torch.empty(3, 16)]}, ValueError, "out has 1 entries"),
        ({"out": [torch.empty(3, 16), torch.empty(5, 15)]}, ValueError, r"out\[1\] has shape"),
        ({"out": [torch.empty(3, 16), torch.empty(5, 16, dtype=torch.half)]}, TypeError, "dtype"),
        ({"accumulate": True}, ValueError, "accumulate"),
    ],
)
def test_grouped_gemm_refusals_name_the_option(kwargs, error, match):
    A, B = _groups("TN", [3, 5])
    args = {"quantization_params": None, "out": [None, None], **kwargs}
    with pytest.raises(error, match=match):
        ce.general_grouped_gemm(
            A, B, args.pop("out"), args.pop("quantization_params"), torch.float32, **args
        )


def test_grouped_gemm_refused_group_writes_nothing():
    A, B = _groups("TN", [3, 5])
    B[1] = B[1][:, :31]  # K mismatch in the second group only
    out = [torch.zeros(3, 16), torch.zeros(5, 16)]
    with pytest.raises(ValueError, match="K mismatch"):
        ce.general_grouped_gemm(A, B, out, None, torch.float32)
    assert all(torch.count_nonzero(o) == 0 for o in out)


def test_grouped_gemm_grad_bias_from_fp8_refused():
    A, B = _groups("NT", [16])
    qb = Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float8_e5m2)(B[0])
    with pytest.raises(NotImplementedError, match="FP8"):
        ce.general_grouped_gemm(
            A, [qb], [None], None, torch.float32, layout="NT", grad=True, use_bias=True, bias=[None]
        )
