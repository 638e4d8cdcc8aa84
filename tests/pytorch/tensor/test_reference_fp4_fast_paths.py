"""The NVFP4 reference's arithmetic E2M1 encode/decode, cached RHT matrix, buffer-free amax and
one-GEMM RHT against their former forms (``torch.bucketize`` over the grid, gathers; the cached
matrix against a fresh build; a batched product over the input's own layout), bit for bit (the
RHT, a float32 GEMM whose summation order is the BLAS's, within the float32 bound of the float64
transform).

``reference_fp4`` is NVFP4's cast on every device, so its faster forms must give the very same
codes, values and amaxes; stochastic rounding must consume the same random draws.
"""

import pytest
import torch

from transformer_engine.pytorch import reference_fp4 as fp4

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ---- the former implementations (oracles) -------------------------------------------------


def old_e2m1_encode(v, stochastic=False, generator=None):
    v = v.float()
    grid = torch.tensor(GRID, dtype=torch.float32)
    mag = torch.nan_to_num(v.abs(), nan=0.0).clamp(max=6.0).contiguous()
    lo = (torch.bucketize(mag, grid, right=True) - 1).clamp(0, 7)
    hi = (lo + 1).clamp(max=7)
    below, above = mag - grid[lo], grid[hi] - mag
    if stochastic:
        gap = grid[hi] - grid[lo]
        p = torch.where(gap > 0, below / torch.where(gap > 0, gap, 1.0), 0.0)
        u = torch.rand(mag.shape, generator=generator, dtype=torch.float32)
        up = u < p
    else:
        up = (above < below) | ((above == below) & (hi % 2 == 0) & (hi != lo))
    code = torch.where(up, hi, lo).to(torch.uint8)
    sign = torch.signbit(v) & ~torch.isnan(v)
    return code | (sign.to(torch.uint8) << 3)


def old_e2m1_decode(codes):
    grid = torch.tensor(GRID, dtype=torch.float32)
    mag = grid[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def old_global_amax(a):
    v = a.detach().float().abs()
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)
    return v.amax().reshape(1) if v.numel() else torch.zeros(1)


def old_apply_rht(a, inverse=False, with_random_sign_mask=True):
    r, c = a.shape
    full = (c // 16) * 16
    mat = fp4.rht_matrix(with_random_sign_mask, a.device)
    if not inverse:
        mat = mat.t()
    out = a.float().clone()
    blocks = out[:, :full].reshape(r, full // 16, 16)
    out[:, :full] = (blocks @ mat).reshape(r, full)
    return out


# ---- inputs -------------------------------------------------------------------------------


def encode_inputs():
    """Every multiple of 2**-12 in [-7, 7] (all grid points, all ties, both sides of every
    binade edge), float32 neighbours of the grid points and ties, subnormals, +-0, +-Inf, NaN,
    and random values of several magnitudes."""
    fine = torch.arange(-7 * 4096, 7 * 4096 + 1, dtype=torch.float32) / 4096
    points = torch.tensor(GRID + (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0), dtype=torch.float32)
    neighbours = torch.cat([torch.nextafter(points, torch.tensor(d)) for d in (-1.0, 10.0)])
    specials = torch.tensor([0.0, -0.0, 1e-45, 1e-40, float("inf"), -float("inf"), float("nan")])
    g = torch.Generator().manual_seed(5)
    random = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-6, 6, (4096,), generator=g))
    values = torch.cat([fine, points, neighbours, specials, random])
    return torch.cat([values, -values]).reshape(-1, 2)


# ---- tests ----------------------------------------------------------------------------------


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    view = {1: torch.uint8, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def test_round_to_nearest_encode_gives_the_former_codes():
    v = encode_inputs()
    same_bits(fp4.e2m1_encode(v), old_e2m1_encode(v))
    same_bits(fp4.e2m1_encode(v.t()), old_e2m1_encode(v.t()))  # strided


def test_stochastic_encode_gives_the_former_codes_from_the_same_draws():
    v = encode_inputs()
    for seed in range(3):
        got = fp4.e2m1_encode(v, stochastic=True, generator=torch.Generator().manual_seed(seed))
        want = old_e2m1_encode(v, stochastic=True, generator=torch.Generator().manual_seed(seed))
        same_bits(got, want)


def test_decode_gives_the_former_values():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8) & 0xF
    same_bits(fp4.e2m1_decode(codes), old_e2m1_decode(codes))
    same_bits(
        fp4.e2m1_decode(codes.reshape(16, 16).t()), old_e2m1_decode(codes.reshape(16, 16).t())
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_global_amax_gives_the_former_amax(dtype):
    g = torch.Generator().manual_seed(7)
    cases = [torch.randn(33, 70, generator=g, dtype=torch.float64) * 1e3, torch.zeros(4, 4).neg()]
    with_nan = torch.randn(10, 10, generator=g, dtype=torch.float64)
    with_nan[3, 4] = float("nan")
    with_inf = torch.randn(10, 10, generator=g, dtype=torch.float64)
    with_inf[1, 1] = -float("inf")
    cases += [with_nan, with_inf, torch.full((3, 3), float("nan")), torch.zeros(0, 5)]
    for a in cases:
        a = a.to(dtype)
        same_bits(fp4.global_amax(a), old_global_amax(a))


@pytest.mark.parametrize("signs", [True, False])
def test_cached_rht_matrix_is_a_fresh_build_and_a_fresh_tensor(signs):
    # The cache changes no value (test_nvfp4_tensor.py holds the transform to oracle_rht).
    built = fp4._build_rht_matrix(signs, None)
    first = fp4.rht_matrix(signs)
    same_bits(first, built)
    first.zero_()  # a caller may write its copy; the next call is unaffected
    same_bits(fp4.rht_matrix(signs), built)


def within_summation_bound(new, old, a, inverse, signs):
    """``new`` and ``old`` (float32 transforms of ``a``) both within the float32 error bound of
    a 16-term sum of the float64 transform: every product by a +-1/4 entry is exact, so each
    output errs by at most gamma_15 = 15u / (1 - 15u) times the sum of its terms' magnitudes.
    (Not bit for bit: the BLAS sums a block's 16 terms in an order of its own, which differs
    between CPUs, AVX2 and AMX ones, and between the shapes of the one GEMM and the batch.)"""
    assert new.dtype == old.dtype == torch.float32 and new.shape == old.shape == a.shape
    full = (a.shape[1] // 16) * 16
    mat = fp4.rht_matrix(signs, a.device).double()
    mat = mat if inverse else mat.t()
    blocks = a.double()[:, :full].reshape(a.shape[0], full // 16, 16)
    exact = (blocks @ mat).reshape(a.shape[0], full)
    u = 2.0**-24
    bound = (15 * u / (1 - 15 * u)) * (blocks.abs() @ mat.abs()).reshape(a.shape[0], full)
    for got in (new, old):
        assert bool(((got[:, :full].double() - exact).abs() <= bound).all())
        same_bits(got[:, full:], a[:, full:].float())  # a trailing partial block: untouched
    # Both do round: the bound is not vacuous (some outputs differ from the float64 values).
    if full * a.shape[0] >= 256:
        assert not torch.equal(new[:, :full].double(), exact)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("signs", [True, False])
def test_rht_gives_the_former_values_in_the_inputs_layout(inverse, signs):
    """Values of wide dynamic range (every 16-term sum rounds), row-major and transposed (the
    column-wise casts' view) inputs, a trailing partial block, a sliced view, bfloat16; the
    input is never written, and a transposed input gives a transposed (column-major) result,
    the layout the callers' GEMMs had read."""
    g = torch.Generator().manual_seed(9)
    for shape in [(256, 512), (64, 96), (40, 33), (7, 5), (1, 16)]:
        a = torch.randn(shape, generator=g) * torch.exp(3 * torch.randn(shape, generator=g))
        for view in (a, a.t(), a[:, 1:], a.to(torch.bfloat16), a.to(torch.bfloat16).t()):
            before = view.clone()
            new = fp4.apply_rht(view, inverse=inverse, with_random_sign_mask=signs)
            within_summation_bound(new, old_apply_rht(view, inverse, signs), view, inverse, signs)
            assert torch.equal(view, before)
            if view.dim() == 2 and min(view.shape) > 1 and view.t().is_contiguous():
                assert new.t().is_contiguous()
