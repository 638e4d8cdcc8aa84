"""The native LayerNorm/RMSNorm kernels (cpp_extensions.norm_kernels) on the GPU: forward
against a float64 oracle, the FP8 output bit for bit against the package's own cast of the
kernel's high-precision output, backward against float64 autograd, unaligned input, a device
other than the current one, and CUDA-graph capture."""

import pytest
import torch

from transformer_engine.common.native import native_module
from transformer_engine.pytorch.cpp_extensions._routing import launch_args, tensor_arg
from transformer_engine.pytorch.cpp_extensions.cast import quantize
from transformer_engine.pytorch.cpp_extensions.norm_kernels import (
    norm_amax,
    norm_backward,
    norm_forward,
    norm_forward_fp8,
    norm_forward_fp8_from_stats,
    stats_buffers,
)

# Marks, not a module-level skip: a file whose every test is skipped still collects them (a
# module-level skip collects nothing, which pytest reports as a failure exit status).
pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (the native norm kernels); runs on the GPU machine",
    ),
    pytest.mark.skipif(
        torch.cuda.is_available() and native_module() is None,
        reason="needs the native library (pip install --no-build-isolation .)",
    ),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (5, 8200): the forward's teams of three vectors a thread with the third one a single vector.
# (700, 10240): those teams staging each next row in shared memory, more rows than the resident
# teams, so every team walks several rows through both buffers (the last vector padding).
# (1, 64), (19, 136), (37, 256): the forward's half-warp teams (H <= 256), an odd row count so
# that the two teams of a warp walk different numbers of rows; 136: a second vector on one lane.
# (4500, 760), (300, 768), (1100, 2056), (600, 5120), (200, 6144): the forward's smaller
# 3-vector teams (a warp, 4 and 8 warps), staged, with padding vectors and (4500, 1100, 600 rows)
# more rows than the resident teams; 768 and 6144 fill every vector (RMSNorm: 768 takes the
# 2-vector team, 6144 the unstaged kernel). (600, 5120), (200, 6144) 16-bit: the backward's staged
# kernel as two blocks of 256 a SM (5120: padding vectors; 600 rows: several a block). (3000,
# 328), (4500, 760), (300, 768), (2000, 1288), (1100, 2056) 16-bit: the backward's staged kernel
# with several teams a block (32 half warps, 16 warps, 8 teams of 2 warps, 4 of 4 warps), with
# more rows than teams (several a team, unevenly) or fewer (300: teams and blocks without rows),
# their partials added up through shared memory; 328 and 1288: the forward's 3-vector teams of
# half a warp and 2 warps.
SHAPES = [(1, 1), (3, 7), (17, 33), (1, 64), (19, 136), (37, 256), (128, 1024), (257, 4096),
          (64, 8192), (5, 8200), (8, 12288), (700, 10240), (3, 40000), (0, 64), (4500, 760),
          (300, 768), (1100, 2056), (600, 5120), (200, 6144), (2000, 1288),
          (3000, 328)]  # fmt: skip
# One rounding of the output dtype (float32: accumulated float32 arithmetic over long rows).
RTOL = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 1e-5}
EPS = 1e-5


def make_case(shape, dtype, wdtype, rms, zero_centered, device="cuda", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=g) + 1.5).to(dtype)
    hidden = shape[-1]
    w = torch.randn(hidden, generator=g) * (0.1 if zero_centered else 0.5)
    w = (w if zero_centered else w + 1).to(wdtype)
    b = None if rms else (0.5 * torch.randn(hidden, generator=g)).to(wdtype)
    dz = torch.randn(shape, generator=g).to(dtype)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x), to(w), to(b), to(dz)


def effective_gamma64(w, zero_centered):
    """The kernel forms 1 + w in float32; the oracle takes that float32 value exactly."""
    w32 = w.float()
    return ((w32 + 1) if zero_centered else w32).double()


def oracle_forward(x, w, b, rms, zero_centered):
    x64 = x.double().cpu().reshape(-1, x.shape[-1])
    g = effective_gamma64(w, zero_centered).cpu()
    mean = torch.zeros(x64.shape[0], dtype=torch.float64) if rms else x64.mean(dim=1)
    centered = x64 - mean[:, None]
    rsigma = torch.rsqrt(centered.square().mean(dim=1) + EPS)
    y = centered * rsigma[:, None] * g
    if b is not None:
        y = y + b.double().cpu()
    return y.reshape(x.shape), mean, rsigma


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("wdtype_is_x", [False, True], ids=["w_fp32", "w_xdtype"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zc"])
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_forward_matches_float64(shape, wdtype_is_x, dtype, zero_centered, rms):
    wdtype = dtype if wdtype_is_x else torch.float32
    x, w, b, _ = make_case(shape, dtype, wdtype, rms, zero_centered)
    y, mean, rsigma = norm_forward(x, w, b, EPS, zero_centered, rms=rms)
    assert y.dtype == dtype and y.shape == x.shape
    assert (mean is None) == rms and rsigma.shape == (shape[0],)
    ref_y, ref_mean, ref_rsigma = oracle_forward(x, w, b, rms, zero_centered)
    if shape[0] == 0:
        return
    torch.testing.assert_close(rsigma.double().cpu(), ref_rsigma, rtol=1e-5, atol=0)
    if not rms:
        torch.testing.assert_close(mean.double().cpu(), ref_mean, rtol=1e-5, atol=1e-6)
    scale = ref_y.abs().max().item()
    torch.testing.assert_close(y.double().cpu(), ref_y, rtol=RTOL[dtype], atol=1e-5 * scale)
    if dtype != torch.float32 and y.numel() >= 1000:
        same = (y.cpu() == ref_y.to(dtype)).double().mean().item()
        assert same >= 0.999, f"only {same:.5f} of y equal the float64 oracle rounded"


@pytest.mark.parametrize("hidden", [24, 1000, 4096, 12288], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tiny", [False, True], ids=["integers", "subnormal_means"])
def test_mean_is_the_correctly_rounded_quotient(hidden, dtype, tiny):
    """Rows whose sums are exact in float32 (small integers, or small multiples of 2^-126 whose
    means fall among the subnormals): the mean must be the float32 quotient sum / H correctly
    rounded, as IEEE division gives it. The kernels multiply by 1 / H where H is a power of two
    (4096; bitwise the quotient) and divide otherwise (24, 12288; 1000 takes the looped
    kernel)."""
    if tiny and dtype == torch.float16:
        pytest.skip("float16 holds no value whose mean is a float32 subnormal (its least is 2^-24)")
    g = torch.Generator().manual_seed(7)
    k = torch.randint(-8, 9, (64, hidden), generator=g).double()
    x64 = k * 2.0**-126 if tiny else k
    x = x64.to(dtype)
    assert torch.equal(x.double(), x64), "the inputs must be exact in the input dtype"
    w = torch.ones(hidden)
    _, mean, _ = norm_forward(x.cuda(), w.cuda(), None, EPS, False, rms=False)
    # The float64 sum is exact and so is its float32 value (|sum| < 2^24 units); the float32
    # division on the CPU is correctly rounded, subnormal results included.
    expected = x64.sum(dim=1).float() / hidden
    if tiny:
        assert (expected.abs() < torch.finfo(torch.float32).tiny).any()
    assert torch.equal(mean.cpu().view(torch.int32), expected.view(torch.int32))


# (64, 1536): 32 staged rows of the transposed copy take exactly 48 KiB of shared memory, which
# with the kernel's static scratch is past the default per-block limit.
@pytest.mark.parametrize("shape", SHAPES + [(64, 1536)], ids=str)
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_fp8_output_equals_cast_of_high_precision_output(shape, fp8_dtype, dtype, rms):
    zero_centered = rms  # both settings covered across the kinds
    x, w, b, _ = make_case(shape, dtype, torch.float32, rms, zero_centered, seed=3)
    y, mean, rsigma = norm_forward(x, w, b, EPS, zero_centered, rms=rms)
    scale = torch.tensor([50.0], device="cuda")  # large enough that E4M3 saturates some values
    amax = torch.zeros(1, device="cuda")
    res, mean8, rsigma8 = norm_forward_fp8(
        x, w, b, EPS, zero_centered, rms=rms, scale=scale, fp8_dtype=fp8_dtype, amax=amax,
        with_transpose=True,
    )  # fmt: skip
    ref_amax = torch.zeros(1, device="cuda")
    ref = quantize(y, scale, fp8_dtype, amax=ref_amax, with_transpose=True)
    assert torch.equal(res.data.view(torch.uint8), ref.data.view(torch.uint8))
    hidden = shape[-1]
    assert res.transpose.shape == (hidden, shape[0])
    assert torch.equal(
        res.transpose.view(torch.uint8), res.data.view(torch.uint8).reshape(-1, hidden).t()
    )
    assert torch.equal(res.scale_inv.cpu(), 1 / scale.cpu())  # IEEE float32 division
    expected_amax = y.float().abs().max().item() if y.numel() else 0.0
    assert amax.item() == expected_amax == ref_amax.item()
    assert torch.equal(rsigma8, rsigma) and (rms or torch.equal(mean8, mean))
    only = torch.full((1,), 123.0, device="cuda")  # overwritten, not max-accumulated
    assert norm_amax(x, w, b, EPS, zero_centered, rms=rms, amax=only) is only
    assert only.item() == expected_amax
    # Current scaling's two passes: the amax pass writes the statistics, the second pass
    # both copies from them; the same statistics, bytes and amax.
    mean2, rsigma2 = stats_buffers(x, rms)
    only.fill_(123.0)
    norm_amax(x, w, b, EPS, zero_centered, rms=rms, amax=only, mean=mean2, rsigma=rsigma2)
    assert only.item() == expected_amax
    assert torch.equal(rsigma2, rsigma) and (rms or torch.equal(mean2, mean))
    amax3 = torch.zeros(1, device="cuda")
    res3 = norm_forward_fp8_from_stats(
        x, w, b, zero_centered, rms=rms, mean=mean2, rsigma=rsigma2, scale=scale,
        fp8_dtype=fp8_dtype, amax=amax3,
    )  # fmt: skip
    assert torch.equal(res3.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(res3.transpose.view(torch.uint8), ref.transpose.view(torch.uint8))
    assert torch.equal(res3.scale_inv.cpu(), 1 / scale.cpu())
    assert amax3.item() == expected_amax
    # Without the transposed copy, and without amax: the same bytes.
    res2, _, _ = norm_forward_fp8(x, w, b, EPS, zero_centered, rms=rms, scale=scale,
                                  fp8_dtype=fp8_dtype)  # fmt: skip
    assert res2.transpose is None and torch.equal(res2.data.view(torch.uint8),
                                                  res.data.view(torch.uint8))  # fmt: skip


@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_transposed_copy_needs_the_statistics(rms):
    """nvte_norm_forward writes the transposed copy from the statistics it writes first, so it
    refuses output_t without them, naming the fix, and writes nothing."""
    native = native_module()
    x, w, b, _ = make_case((8, 64), torch.bfloat16, torch.float32, rms, False)
    out = torch.zeros(8, 64, dtype=torch.uint8, device="cuda")
    out_t = torch.zeros(64, 8, dtype=torch.uint8, device="cuda")
    scale = torch.ones(1, device="cuda")
    mean = None if rms else torch.empty(8, device="cuda")

    def call(mean, rsigma):
        native.norm_forward(
            tensor_arg(x), tensor_arg(w), tensor_arg(b), EPS, False, rms,
            tensor_arg(out.view(torch.float8_e4m3fn)), tensor_arg(scale),
            tensor_arg(out_t.view(torch.float8_e4m3fn)), None, None, tensor_arg(mean),
            tensor_arg(rsigma), *launch_args(x.device),
        )  # fmt: skip

    with pytest.raises(ValueError, match="output_t needs the statistics: pass rsigma"):
        call(mean, None)
    if not rms:
        with pytest.raises(ValueError, match="pass rsigma and mean"):
            call(None, torch.empty(8, device="cuda"))
    torch.cuda.synchronize()
    assert not out.any() and not out_t.any()


def oracle_backward(x, w, b, dz, rms, zero_centered):
    """Float64 autograd through the forward formula (dgamma of the stored weight equals that
    of the effective scale)."""
    x64 = x.double().cpu().requires_grad_()
    g = effective_gamma64(w, zero_centered).cpu().requires_grad_()
    b64 = None if b is None else b.double().cpu().requires_grad_()
    x2 = x64.reshape(-1, x.shape[-1])
    mean = 0 if rms else x2.mean(dim=1, keepdim=True)
    centered = x2 - mean
    y = centered * torch.rsqrt(centered.square().mean(dim=1, keepdim=True) + EPS) * g
    if b64 is not None:
        y = y + b64
    inputs = [x64, g] + ([b64] if b64 is not None else [])
    grads = torch.autograd.grad(y, inputs, dz.double().cpu().reshape(y.shape))
    return grads[0], grads[1], grads[2] if b64 is not None else None


def assert_close_to_max(actual, expected, rtol, scale=0.0):
    """Within ``rtol`` of the larger of ``max |expected|`` and ``scale`` (the size of terms that
    cancel: with one feature, LayerNorm's dx is exactly 0 and RMSNorm's nearly so, while the
    float32 terms it is the difference of are of size ``rsigma * |dz * gamma|``)."""
    tol = rtol * max(expected.abs().max().item(), scale, 1e-30)
    torch.testing.assert_close(actual.double().cpu(), expected, rtol=0, atol=tol)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("wdtype_is_x", [False, True], ids=["w_fp32", "w_xdtype"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zc"])
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_backward_matches_float64(shape, wdtype_is_x, dtype, zero_centered, rms):
    wdtype = dtype if wdtype_is_x else torch.float32
    x, w, b, dz = make_case(shape, dtype, wdtype, rms, zero_centered, seed=1)
    _, mean, rsigma = norm_forward(x, w, b, EPS, zero_centered, rms=rms)
    dx, dgamma, dbeta = norm_backward(dz, x, mean, rsigma, w, zero_centered, rms=rms,
                                      with_dbeta=not rms)  # fmt: skip
    assert dx.dtype == dtype and dx.shape == x.shape
    assert dgamma.dtype == wdtype and (dbeta is None) == rms
    ref_dx, ref_dg, ref_db = oracle_backward(x, w, b, dz, rms, zero_centered)
    if shape[0] == 0:
        assert not dgamma.any() and (rms or not dbeta.any())
        return
    dx_rtol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}[dtype]
    terms = dz.double().cpu().reshape(-1, shape[-1]) * effective_gamma64(w, zero_centered).cpu()
    terms = (terms.abs().amax(dim=1) * rsigma.double().cpu()).max().item()
    assert_close_to_max(dx, ref_dx, dx_rtol, scale=terms)
    # Float32 sums over the rows; rounded once to the weight's dtype.
    sum_rtol = max(1e-4, RTOL[wdtype] * 2)
    assert_close_to_max(dgamma, ref_dg, sum_rtol)
    if not rms:
        assert_close_to_max(dbeta, ref_db, sum_rtol)
    # Deterministic: a second run gives the same bits.
    dx2, dgamma2, _ = norm_backward(dz, x, mean, rsigma, w, zero_centered, rms=rms,
                                    with_dbeta=not rms)  # fmt: skip
    assert torch.equal(dx2, dx) and torch.equal(dgamma2, dgamma)


# Long rows, with more rows than the persistent grid has blocks (132 or 264 on an H200), so every
# block adds several rows into its column partials: the staged kernel (16-bit, H in (8192, 16384],
# each next row staged in shared memory; 3 vectors a thread up to 12288, else 4; 13320 and 9224
# leave the last vectors of the team as padding, and 133 rows give one block a second row) and
# the looped kernel (longer rows, H % 8 != 0, float32 past 8192).
LONG_ROW_CASES = [((600, 12288), torch.bfloat16), ((600, 16384), torch.float16),
                  ((400, 13320), torch.bfloat16), ((133, 9224), torch.float16),
                  ((300, 20000), torch.bfloat16), ((300, 20003), torch.bfloat16),
                  ((300, 12288), torch.float32)]  # fmt: skip


@pytest.mark.parametrize("shape,dtype", LONG_ROW_CASES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_backward_of_long_rows_matches_float64(shape, dtype, rms):
    x, w, b, dz = make_case(shape, dtype, torch.float32, rms, False, seed=3)
    _, mean, rsigma = norm_forward(x, w, b, EPS, False, rms=rms)
    dx, dgamma, dbeta = norm_backward(dz, x, mean, rsigma, w, False, rms=rms, with_dbeta=not rms)
    ref_dx, ref_dg, ref_db = oracle_backward(x, w, b, dz, rms, False)
    dx_rtol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}[dtype]
    terms = dz.double().cpu() * w.double().cpu()
    terms = (terms.abs().amax(dim=1) * rsigma.double().cpu()).max().item()
    assert_close_to_max(dx, ref_dx, dx_rtol, scale=terms)
    assert_close_to_max(dgamma, ref_dg, 1e-4)
    if not rms:
        assert_close_to_max(dbeta, ref_db, 1e-4)
    dx2, dgamma2, _ = norm_backward(dz, x, mean, rsigma, w, False, rms=rms, with_dbeta=not rms)
    assert torch.equal(dx2, dx) and torch.equal(dgamma2, dgamma)


def test_backward_of_a_wider_row_after_a_narrower_one():
    """The staged kernels' shared-memory limits are set once per kernel and device: calls that
    alternate between the two (3 and 4 vectors a thread) must each launch."""
    for hidden in (9216, 16384, 12288):
        x, w, b, dz = make_case((4, hidden), torch.bfloat16, torch.bfloat16, False, False, seed=4)
        _, mean, rsigma = norm_forward(x, w, b, EPS, False, rms=False)
        dx, dgamma, _ = norm_backward(dz, x, mean, rsigma, w, False, rms=False, with_dbeta=True)
        ref_dx, ref_dg, _ = oracle_backward(x, w, b, dz, False, False)
        terms = (dz.double().cpu() * w.double().cpu()).abs().amax(dim=1) * rsigma.double().cpu()
        assert_close_to_max(dx, ref_dx, 1e-2, scale=terms.max().item())
        assert_close_to_max(dgamma, ref_dg, RTOL[torch.bfloat16] * 2)


def _unaligned_copy(t):
    """A contiguous copy of t whose storage starts one element past an aligned allocation."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("shape", [(33, 1024), (5, 4096), (3, 12288)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_unaligned_input_gives_the_same_bits(shape, dtype, rms):
    """The wrappers copy an input at an odd offset into its own aligned allocation, so the
    same kernels (and the same summation order) run on it."""
    x, w, b, dz = make_case(shape, dtype, torch.float32, rms, False, seed=2)
    xu, dzu = _unaligned_copy(x), _unaligned_copy(dz)
    assert xu.data_ptr() % 16 != 0
    y, mean, rsigma = norm_forward(x, w, b, EPS, False, rms=rms)
    yu, meanu, rsigmau = norm_forward(xu, w, b, EPS, False, rms=rms)
    assert torch.equal(y, yu) and torch.equal(rsigma, rsigmau)
    scale = torch.ones(1, device="cuda")
    r = norm_forward_fp8(x, w, b, EPS, False, rms=rms, scale=scale,
                         fp8_dtype=torch.float8_e4m3fn, with_transpose=True)[0]  # fmt: skip
    ru = norm_forward_fp8(xu, w, b, EPS, False, rms=rms, scale=scale,
                          fp8_dtype=torch.float8_e4m3fn, with_transpose=True)[0]  # fmt: skip
    assert torch.equal(r.data.view(torch.uint8), ru.data.view(torch.uint8))
    assert torch.equal(r.transpose.view(torch.uint8), ru.transpose.view(torch.uint8))
    g = norm_backward(dz, x, mean, rsigma, w, False, rms=rms, with_dbeta=not rms)
    gu = norm_backward(dzu, xu, meanu, rsigmau, w, False, rms=rms, with_dbeta=not rms)
    for a, c in zip(g, gu):
        assert (a is None and c is None) or torch.equal(a, c)


@pytest.mark.parametrize("shape", [(700, 1024), (600, 4096), (300, 12288), (300, 20000)], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_workspace_at_an_unaligned_address_gives_the_same_bits(shape, rms):
    """The kernels access the workspace's partial column sums 16 bytes at a time only where it
    is 16-byte aligned (the wrappers allocate it so); a caller's workspace at a 4-byte offset
    takes 4-byte accesses and must give the same dx, dgamma and dbeta bits (warp teams, one team
    a block, the staged kernel, the looped kernel)."""
    x, w, b, dz = make_case(shape, torch.bfloat16, torch.float32, rms, False, seed=3)
    _, mean, rsigma = norm_forward(x, w, b, EPS, False, rms=rms)
    expected = norm_backward(dz, x, mean, rsigma, w, False, rms=rms, with_dbeta=not rms)
    native = native_module()
    rows, hidden = shape
    elements = native.norm_backward_workspace_elements(rows, hidden, x.device.index)
    workspace = torch.empty(elements + 1, dtype=torch.float32, device="cuda")[1:]
    assert workspace.data_ptr() % 16 != 0
    dx = torch.empty_like(x)
    dgamma = torch.empty(hidden, dtype=w.dtype, device="cuda")
    dbeta = None if rms else torch.empty(hidden, dtype=w.dtype, device="cuda")
    native.norm_backward(
        tensor_arg(dz), tensor_arg(x), tensor_arg(mean), tensor_arg(rsigma), tensor_arg(w),
        False, rms, tensor_arg(dx), tensor_arg(dgamma), tensor_arg(dbeta), tensor_arg(workspace),
        *launch_args(x.device),
    )  # fmt: skip
    assert torch.equal(dx, expected[0]) and torch.equal(dgamma, expected[1])
    assert rms or torch.equal(dbeta, expected[2])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_second_device_while_first_is_current():
    x, w, b, dz = make_case((64, 1024), torch.bfloat16, torch.float32, False, False)
    ref = norm_forward(x, w, b, EPS, False, rms=False)
    ref_b = norm_backward(dz, x, ref[1], ref[2], w, False, rms=False, with_dbeta=True)
    dev = torch.device("cuda:1")
    with torch.cuda.device(0):
        y, mean, rsigma = norm_forward(x.to(dev), w.to(dev), b.to(dev), EPS, False, rms=False)
        back = norm_backward(dz.to(dev), x.to(dev), mean, rsigma, w.to(dev), False, rms=False,
                             with_dbeta=True)  # fmt: skip
        assert torch.cuda.current_device() == 0
    assert y.device == dev and torch.equal(y.cpu(), ref[0].cpu())
    for a, c in zip(back, ref_b):
        assert a.device == dev and torch.equal(a.cpu(), c.cpu())
    with pytest.raises(ValueError, match="weight is on cuda:0"):
        norm_forward(x.to(dev), w, None, EPS, False, rms=True)


# (16384, 1024): a main backward kernel long enough that a finalize kernel started as its
# programmatic dependent would read unfinished partial rows if it did not wait for it.
@pytest.mark.parametrize("shape", [(96, 2048), (16384, 1024)], ids=["small", "long"])
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_cuda_graph_capture_of_fp8_forward_and_backward(rms, shape):
    x, w, b, dz = make_case(shape, torch.bfloat16, torch.float32, rms, True, seed=4)
    scale = torch.tensor([8.0], device="cuda")
    amax = torch.zeros(1, device="cuda")

    def step():
        amax.zero_()
        res, mean, rsigma = norm_forward_fp8(x, w, b, EPS, True, rms=rms, scale=scale,
                                             fp8_dtype=torch.float8_e4m3fn, amax=amax,
                                             with_transpose=True)  # fmt: skip
        grads = norm_backward(dz, x, mean, rsigma, w, True, rms=rms, with_dbeta=not rms)
        return res, grads

    eager_res, eager_grads = step()  # warm-up on the current stream, before capture
    eager_amax = amax.clone()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        res, grads = step()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(res.data.view(torch.uint8), eager_res.data.view(torch.uint8))
    assert torch.equal(res.transpose.view(torch.uint8), eager_res.transpose.view(torch.uint8))
    assert torch.equal(amax, eager_amax)
    for a, c in zip(grads, eager_grads):
        assert (a is None and c is None) or torch.equal(a, c)
