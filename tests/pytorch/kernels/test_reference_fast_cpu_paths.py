"""The fast CPU forms of the reference cast, amax, transpose and FP8 upcast against their
former plain forms, bit for bit.

``transformer_engine.pytorch.reference`` is both the CPU execution path and the specification
the CUDA kernels are held to, so its faster forms (one reduction deciding whether a clamp and
a NaN fix-up are needed, writes straight into the outputs, FP8 -> float32 through float16 bit
moves) must give the very same bits. The oracles below are the previous implementations, kept
verbatim in meaning: a few whole-tensor torch operations whose semantics are easy to read.
"""

import pytest
import torch

from transformer_engine.pytorch import reference
from transformer_engine.pytorch.cpp_extensions import cast
from transformer_engine.pytorch.cpp_extensions.fp8_gemm_cpu import (
    float32_product_of_fp8_values,
    fp8_gemm_emulated,
)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALES = (1.0, 0.37, 1000.0, 2.0**-10, 3.0e38, 0.0, float("inf"), float("nan"))
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


# ---- the former implementations (oracles) -------------------------------------------------


def old_amax(x):
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32)
    a = x.detach().float().abs()
    a = torch.where(torch.isnan(a), torch.zeros((), dtype=a.dtype), a)
    return a.amax().reshape(1)


def old_cast_to_fp8(x, scale, dtype):
    limit = FP8_MAX[dtype]
    v = x.detach().float() * scale.detach().float().reshape(())
    bits = v.clamp(-limit, limit).to(dtype).view(torch.uint8)
    nan_bits = torch.full((), 0x7F, dtype=torch.uint8)
    return torch.where(torch.isnan(v), nan_bits, bits).view(dtype)


def old_transpose(data):
    cols = data.shape[-1]
    t = data.reshape(-1, cols).view(torch.uint8).t().contiguous().view(data.dtype)
    return t.reshape(cols, *data.shape[:-1])


def old_dequantize(data, scale_inv, out_dtype):
    return (data.float() * scale_inv.float().reshape(())).to(out_dtype)


def old_gemm_emulated(x, y, sx, sy, bias, out_dtype):
    # torch's own upcast into the same float32 GEMM (same math mode), so the same accumulation
    # order: what is compared is the upcast through float16 bit moves and the folded factor.
    product = float32_product_of_fp8_values(x.to(torch.float32), y.to(torch.float32))
    product.mul_(sx * sy)
    if bias is not None:
        product.add_(bias)
    return product.to(out_dtype)


# ---- inputs -------------------------------------------------------------------------------


def special_values():
    """NaN, +-Inf, +-0, float32 and FP8 subnormals, values at and beyond both FP8 maxima, and
    round-to-nearest-even ties of both formats (normal and subnormal)."""
    values = [float("nan"), float("inf"), 0.0, 1e-40, 1e-45, 2.0**-126, 65504.0, 3.0e38]
    values += [448.0, 449.0, 464.0, 465.0, 480.0, 57344.0, 61439.0, 61440.0, 61441.0, 1e6]
    values += [2.0**-6, 2.0**-7, 2.0**-9, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 0.5 * 2.0**-9]
    values += [2.0**-14, 2.0**-16, 1.5 * 2.0**-16, 2.5 * 2.0**-16, 2.0**-17, 2.0**-18]
    values += [1.0625, 1.1875, 1.125, 1.375, 240.0, 232.0, 248.0, 3.0 * 2.0**-10]
    values += [v * 2.0**-10 for v in (1.0625, 1.1875, 17.0, 19.0)]
    signed = values + [-v for v in values]
    return torch.tensor(signed, dtype=torch.float64)


def inputs(dtype, seed):
    """Random tensors of several magnitudes, one mixed with every special value."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for magnitude in (1.0, 300.0, 1e-3, 1e5):
        out.append((torch.randn(37, 64, generator=g, dtype=torch.float64) * magnitude).to(dtype))
    mixed = torch.randn(19, 32, generator=g, dtype=torch.float64) * 100
    specials = special_values()
    flat = mixed.reshape(-1)
    flat[torch.randperm(flat.numel(), generator=g)[: specials.numel()]] = specials
    out.append(mixed.to(dtype))
    out.append(specials.to(dtype).reshape(-1, 2))
    out.append(torch.zeros(4, 8, dtype=dtype).neg())  # all -0.0
    out.append(torch.full((3, 5), float("nan"), dtype=dtype))
    out.append(torch.randn(6, 7, generator=g, dtype=torch.float64).to(dtype).t())  # strided
    return out


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.contiguous().view(view), b.contiguous().view(view))


# ---- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", INPUT_DTYPES + (torch.float64,))
def test_amax_matches_the_nan_ignoring_float32_max(dtype):
    for seed in range(3):
        for x in inputs(dtype, seed):
            same_bits(reference.amax(x), old_amax(x))
    same_bits(reference.amax(torch.empty(0, 4, dtype=dtype)), old_amax(torch.empty(0, 4)))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_cast_matches_the_clamp_where_cast(fp8_dtype, dtype, scale):
    s = torch.tensor([scale], dtype=torch.float32)
    for seed in range(3):
        for x in inputs(dtype, seed):
            expected = old_cast_to_fp8(x, s, fp8_dtype)
            same_bits(reference.cast_to_fp8(x, s, fp8_dtype), expected)
            out = torch.empty(x.shape, dtype=fp8_dtype)
            data, amax = reference.cast_to_fp8_with_amax(x, s, fp8_dtype, out=out)
            assert data is out
            same_bits(out, expected)
            same_bits(amax, old_amax(x))
            # A given-up float32 buffer (the CPU activation path's) is scaled in place: same bytes.
            data, amax = reference.cast_to_fp8_with_amax(
                x.float().clone(), s, fp8_dtype, consume_input=True
            )
            same_bits(data, expected)
            same_bits(amax, old_amax(x))


def test_cast_leaves_a_float32_input_untouched():
    x = torch.randn(8, 8) * 1000
    before = x.clone()
    reference.cast_to_fp8(x, torch.tensor([0.37]), torch.float8_e4m3fn)
    same_bits(x, before)


def assert_transposes_like_the_copy(data):
    """transpose_last_dim_first, returning a new tensor and into ``out``, gives the bytes of the
    plain copying transpose."""
    expected = old_transpose(data)
    same_bits(reference.transpose_last_dim_first(data), expected)
    out = torch.empty(expected.shape, dtype=data.dtype)
    assert reference.transpose_last_dim_first(data, out=out) is out
    same_bits(out, expected)


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 4), (1, 9), (6,)])
def test_transpose_into_out_matches_the_copying_transpose(shape):
    data = torch.randint(0, 256, shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert_transposes_like_the_copy(data)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_fp8_upcast_matches_torch_on_every_byte(fp8_dtype):
    every_byte = torch.arange(256, dtype=torch.uint8).view(fp8_dtype)
    same_bits(reference.fp8_to_float32(every_byte), every_byte.float())  # NaN bits too
    g = torch.Generator().manual_seed(1)
    noise = torch.randint(0, 256, (64, 33), dtype=torch.uint8, generator=g).view(fp8_dtype)
    same_bits(reference.fp8_to_float32(noise), noise.float())
    no_nan = torch.arange(127, dtype=torch.uint8).view(fp8_dtype)  # the fast exit
    same_bits(reference.fp8_to_float32(no_nan), no_nan.float())
    same_bits(reference.fp8_to_float32(every_byte[:0]), every_byte[:0].float())


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("out_dtype", INPUT_DTYPES)
@pytest.mark.parametrize("scale_inv", (1.0, 0.37, 1000.0, 2.0**-10))
def test_dequantize_matches_upcast_times_scale(fp8_dtype, out_dtype, scale_inv):
    data = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).reshape(16, 16)
    s = torch.tensor([scale_inv])
    same_bits(reference.dequantize(data, s, out_dtype), old_dequantize(data, s, out_dtype))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("scale", (1.0, 0.37, 1000.0, 2.0**-10))
def test_cpu_quantize_writes_what_the_old_composition_wrote(fp8_dtype, dtype, scale):
    s = torch.tensor([scale], dtype=torch.float32)
    for x in inputs(dtype, 5):
        prior = torch.tensor([3.5])
        result = cast.quantize(x, s, fp8_dtype, amax=prior, with_transpose=x.dim() > 0)
        expected = old_cast_to_fp8(x.contiguous(), s, fp8_dtype)
        same_bits(result.data.view(fp8_dtype), expected)
        same_bits(result.transpose.view(fp8_dtype), old_transpose(expected))
        same_bits(prior, torch.maximum(torch.tensor([3.5]), old_amax(x)))
        same_bits(result.scale_inv.reshape(1), torch.ones(1) / s)


@pytest.mark.parametrize("x_dtype", FP8_DTYPES)
@pytest.mark.parametrize("y_dtype", FP8_DTYPES)
@pytest.mark.parametrize("out_dtype", INPUT_DTYPES)
def test_emulated_gemm_matches_the_torch_upcast_gemm(x_dtype, y_dtype, out_dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 256, (24, 40), dtype=torch.uint8, generator=g).view(x_dtype)
    y = torch.randint(0, 256, (16, 40), dtype=torch.uint8, generator=g).view(y_dtype)
    x_finite = torch.randn(24, 40, generator=g).to(x_dtype)  # most rows without NaN
    sx, sy = torch.tensor([0.37]), torch.tensor([2.0**-10])
    bias = torch.randn(16, generator=g)
    precision_before = torch.backends.mkldnn.matmul.fp32_precision
    for a in (x, x_finite):
        for b in (bias, None):
            got = fp8_gemm_emulated(a, y, sx, sy, bias=b, out_dtype=out_dtype)
            assert torch.backends.mkldnn.matmul.fp32_precision == precision_before
            expected = old_gemm_emulated(a, y, sx, sy, b, out_dtype)
            # Same float32 operands into the same torch.mm: equal, NaN where NaN.
            assert torch.equal(got.isnan(), expected.isnan())
            same_bits(torch.nan_to_num(got, nan=0.0), torch.nan_to_num(expected, nan=0.0))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_unscaled_fp8_upcast_times_its_factor_is_torch_upcast(fp8_dtype):
    every_byte = torch.arange(256, dtype=torch.uint8)
    nan_byte = 0x7F if fp8_dtype == torch.float8_e4m3fn else 0x7D
    finite = every_byte[(every_byte & 0x7F) < nan_byte]  # Inf stays on the fast route (E5M2)
    cases = [
        finite.view(fp8_dtype),  # every non-NaN byte: zeros, subnormals, the maxima
        finite.view(fp8_dtype).reshape(-1, 2).t(),  # non-contiguous
        every_byte.view(fp8_dtype)[:0],
        torch.randint(0, 256, (33, 17), dtype=torch.uint8).view(fp8_dtype),
    ]
    for nan in (0x7F, 0xFF, 0x7D, 0xFD, 0x7E, 0xFE):  # each NaN byte alone among finite ones
        cases.append(torch.cat((finite, torch.tensor([nan], dtype=torch.uint8))).view(fp8_dtype))
    for data in cases:
        value, factor = reference.fp8_to_float32_unscaled(data)
        is_nan_byte = (data.view(torch.uint8) & 0x7F) >= nan_byte
        expected_factor = 256.0 if fp8_dtype == torch.float8_e4m3fn else 1.0
        assert factor == (1.0 if bool(is_nan_byte.any()) else expected_factor)
        same_bits(value * factor, data.float())
        same_bits(reference.fp8_to_float32(data), data.float())


@pytest.mark.parametrize(
    "shape",
    [(1024, 256), (256, 1024), (64, 72, 8), (129, 130, 4), (300, 68), (200, 100), (17, 1023)],
)
def test_word_route_byte_transpose_matches_the_copying_transpose(shape):
    # Large enough for the word route (8- or 4-byte words; odd row counts), and sizes that
    # fall back to the byte copy (a row that is no whole number of 4-byte words).
    data = torch.randint(0, 256, shape, dtype=torch.uint8).view(torch.float8_e5m2)
    assert_transposes_like_the_copy(data)
    # Rows starting at an offset that is no whole word (falls back), and non-contiguous input.
    shifted = torch.randint(0, 256, (data.numel() + 1,), dtype=torch.uint8)[1:].view(shape)
    same_bits(reference.transpose_last_dim_first(shifted), old_transpose(shifted))
    strided = torch.randint(0, 256, (shape[-1], data.numel() // shape[-1]), dtype=torch.uint8)
    same_bits(reference.transpose_last_dim_first(strided.t()), old_transpose(strided.t()))


# Scales around the fold of the E4M3 upcast's 2**8 factors into the scale product: normal,
# subnormal (not folded), near FLT_MAX (folding would overflow), 0, Inf, NaN.
FOLD_SCALES = (0.37, 2.0**-10, 2.0**-140, 1e-38, 3.0e38, 2.0**112, 0.0, float("inf"), float("nan"))


@pytest.mark.parametrize("x_dtype", FP8_DTYPES)
@pytest.mark.parametrize("y_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale", FOLD_SCALES)
def test_emulated_gemm_folds_the_upcast_factor_exactly(x_dtype, y_dtype, scale):
    g = torch.Generator().manual_seed(3)
    every = torch.arange(256, dtype=torch.uint8)
    # Every finite byte of each format (subnormals included) on the diagonal of K: products of
    # the smallest subnormals and partial sums across the whole range.
    x_bytes = every[(every & 0x7F) < (0x7F if x_dtype == torch.float8_e4m3fn else 0x7C)]
    k = x_bytes.numel()
    x = torch.cat(
        (x_bytes.view(1, k), torch.randint(0, 256, (5, k), generator=g, dtype=torch.uint8))
    )
    x = torch.where((x & 0x7F) >= 0x7C, x & 0x3F, x).view(x_dtype)  # no NaN/Inf: the fold
    y = torch.randn(7, k, generator=g).mul(2.0 ** torch.randint(-12, 8, (7, k), generator=g))
    y = torch.cat((y, torch.full((1, k), 2.0**-16), torch.full((1, k), 2.0**-9))).to(y_dtype)
    sx, sy = torch.tensor([scale]), torch.tensor([1.0])
    for out_dtype in INPUT_DTYPES:
        for bias in (None, torch.randn(y.shape[0], generator=g)):
            got = fp8_gemm_emulated(x, y, sx, sy, bias=bias, out_dtype=out_dtype)
            same_bits(got, old_gemm_emulated(x, y, sx, sy, bias, out_dtype))
            got = fp8_gemm_emulated(y, x, sy, sx, bias=None, out_dtype=out_dtype)
            same_bits(got, old_gemm_emulated(y, x, sy, sx, None, out_dtype))


# ---- the column-wise block casts, computed in the input's own layout --------------------------


def _block_input(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(shape, generator=g) * 50).to(dtype)
    if a.numel() > 8:  # Inf, NaN, zero and a huge value in the first blocks
        a.view(-1)[[1, 3, 5, 7]] = torch.tensor([float("inf"), float("nan"), 0.0, -3e38]).to(dtype)
    return a


BLOCK_SHAPES = [(1024, 256), (1000, 300), (1, 5), (129, 128), (0, 16), (16, 0), (70, 31)]


@pytest.mark.parametrize("shape", BLOCK_SHAPES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("pow2, epsilon", [(True, 0.0), (False, 0.5)])
def test_block_cast_of_the_transpose_is_the_cast_of_the_transposed_input(
    shape, dtype, fp8_dtype, pow2, epsilon
):
    from transformer_engine.pytorch import reference_blocks

    a = _block_input(shape, dtype, seed=shape[0] + shape[1])
    options = {"epsilon": epsilon, "force_pow_2_scales": pow2, "value_for_inf": 1e30}
    data, scale_inv = reference_blocks.block_cast_1d_of_transpose(a, fp8_dtype, **options)
    want_data, want_scale_inv = reference_blocks.block_cast_1d(a.t(), fp8_dtype, **options)
    assert data.shape == want_data.shape and data.is_contiguous()
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(scale_inv.view(torch.int32), want_scale_inv.view(torch.int32))


@pytest.mark.parametrize("shape", BLOCK_SHAPES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_mxfp8_columnwise_cast_is_the_transposed_cast_of_the_transpose(shape, dtype, fp8_dtype):
    from transformer_engine.pytorch import reference_blocks

    a = _block_input(shape, dtype, seed=7 + shape[0])
    data, exponents = reference_blocks.mxfp8_cast(a, fp8_dtype, columnwise=True)
    want_data, want_exponents = reference_blocks.mxfp8_cast(a.t(), fp8_dtype)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8).t())
    assert torch.equal(exponents, want_exponents.t())
    with pytest.raises(ValueError, match="two_d and columnwise exclude each other"):
        reference_blocks.mxfp8_cast(a, fp8_dtype, two_d=True, columnwise=True)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("columnwise", [False, True])
def test_block_cast_without_a_clamp_gives_the_saturating_cast(fp8_dtype, columnwise):
    """Finite Float8BlockScaling casts skip the clamp: non-power-of-2 scales put ``amax *
    scale`` a rounding above the format's maximum in about one block in ten (checked below),
    and torch's conversion must round those to the maximum, as the clamp-then-cast oracle."""
    from transformer_engine.pytorch import reference_blocks

    g = torch.Generator().manual_seed(3)
    a = torch.rand(512, 1024, generator=g) * 100 + 1e-3
    limit = FP8_MAX[fp8_dtype]
    m = a.t() if columnwise else a
    blocks = m.reshape(m.shape[0], -1, 128)
    amax = blocks.amax(dim=-1, keepdim=True)
    scale = torch.full_like(amax, limit) / amax
    scaled = blocks * scale
    assert bool((scaled.amax(dim=-1) > limit).any())  # the case the test is about occurs
    want = scaled.clamp(-limit, limit).to(fp8_dtype).reshape(m.shape)
    options = {"force_pow_2_scales": False}
    if columnwise:
        data, _ = reference_blocks.block_cast_1d_of_transpose(a, fp8_dtype, **options)
    else:
        data, _ = reference_blocks.block_cast_1d(a, fp8_dtype, **options)
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(300, 260), (128, 128), (1, 1), (0, 5)])
@pytest.mark.parametrize(
    "scales", [(2.0**-20, 1.0, 3.0), (2.0**125, 0.5, 1.0), (float("inf"), 1.0, 2.0),
               (1e-45, 1.0, 7.0), (0.37, 1e30, 5e-39)],
)  # fmt: skip
@pytest.mark.parametrize("with_nan_bytes", [False, True])
def test_block_dequantize_is_torch_upcast_times_the_block_scale(
    fp8_dtype, shape, scales, with_nan_bytes
):
    """The block dequantizers fold the FP8 upcast's power-of-two factor into the scales (or
    not, for scales it would overflow): the bits of torch's upcast times the scale."""
    from transformer_engine.pytorch import reference_blocks

    g = torch.Generator().manual_seed(shape[0] + len(scales))
    top = 256 if with_nan_bytes else (127 if fp8_dtype == torch.float8_e4m3fn else 125)
    magnitude = torch.randint(0, min(top, 128), shape, generator=g, dtype=torch.int16)
    sign = torch.randint(0, 2, shape, generator=g, dtype=torch.int16) * 128
    data = (magnitude + sign).to(torch.uint8).view(fp8_dtype)
    r, c = shape
    rb, cb = -(-r // 128), -(-c // 128)
    table = torch.tensor(scales, dtype=torch.float32)
    s1 = table[torch.randint(0, 3, (cb, max(r, 1)), generator=g)]
    s2 = table[torch.randint(0, 3, (max(rb, 1), cb), generator=g)]

    def same(got, want):
        nan = torch.isnan(want)
        return torch.equal(torch.isnan(got), nan) and torch.equal(
            got.view(torch.int32)[~nan], want.view(torch.int32)[~nan]
        )

    got = reference_blocks.block_dequantize_1d(data, s1, torch.float32)
    assert same(got, data.float() * s1[:cb, :r].t().repeat_interleave(128, dim=1)[:, :c])
    got = reference_blocks.block_dequantize_2d(data, s2, torch.float32)
    expanded = s2.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[:r, :c]
    assert same(got, data.float() * expanded)


def old_block_scale_from_amax(amax, fp8_dtype, epsilon, pow2, value_for_inf):
    a = torch.clamp_min(amax, epsilon) if epsilon > 0 else amax
    scale = torch.full_like(a, FP8_MAX[fp8_dtype]) / a
    scale = torch.where(torch.isposinf(scale), torch.full_like(scale, value_for_inf), scale)
    if pow2:
        scale = (scale.view(torch.int32) & reference.SIGN_AND_EXPONENT_MASK).view(torch.float32)
    return torch.where(a == 0, torch.ones_like(scale), scale)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("epsilon", [0.0, 1e-3, 1e-38])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("value_for_inf", [reference.FLOAT32_MAX, 65504.0])
def test_block_scales_match_the_out_of_place_form(fp8_dtype, epsilon, pow2, value_for_inf):
    from transformer_engine.pytorch import reference_blocks

    g = torch.Generator().manual_seed(5)
    special = [0.0, 1e-45, 1e-40, 1.3e-36, 1.0, 3.0, 448.0, 3e38, float("inf"), 2.0**-126]
    exponents = torch.randint(-40, 38, (400,), generator=g).float()
    amax = torch.cat([torch.tensor(special), torch.rand(400, generator=g) * 10.0**exponents])
    amax = amax.reshape(-1, 5)
    got = reference_blocks.block_scale_from_amax(
        amax, fp8_dtype, epsilon=epsilon, force_pow_2_scales=pow2, value_for_inf=value_for_inf
    )
    want = old_block_scale_from_amax(amax, fp8_dtype, epsilon, pow2, value_for_inf)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
