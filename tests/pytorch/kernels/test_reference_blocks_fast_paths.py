"""The block-scaled reference casts (``reference_blocks``) against their former plain forms,
bit for bit.

``reference_blocks`` is the CPU execution path of Float8BlockScaling and MXFP8 and the
specification their CUDA kernels are held to, so its faster forms (one contiguous float32 copy
of the input, the block amax as ``max(max x, -min x)`` with the NaN-ignoring pass only where a
block holds NaN, the scaling in place in that copy, the NaN search only where a block holds NaN
or Inf) must give the very same bytes and scales. The oracles below are the previous
implementations: whole-tensor torch operations whose semantics are easy to read.
"""

import pytest
import torch

from transformer_engine.pytorch import reference_blocks as RB
from transformer_engine.pytorch.constants import fp8_max
from transformer_engine.pytorch.utils import round_up_to_nearest_multiple as round_up

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- the former implementations (oracles) -------------------------------------------------


def old_saturating_cast(v, fp8_dtype):
    limit = fp8_max(fp8_dtype)
    nan = torch.isnan(v)
    out = v.clamp(-limit, limit).to(fp8_dtype)
    if bool(nan.any()):
        bits = out.view(torch.uint8)
        bits.copy_(torch.where(nan, torch.full_like(bits, 0x7F), bits))
    return out


def old_padded(a, rows, cols):
    r, c = a.shape
    v = a.detach().float()
    pad_r, pad_c = round_up(r, rows) - r, round_up(c, cols) - c
    return torch.nn.functional.pad(v, (0, pad_c, 0, pad_r)) if pad_r or pad_c else v


def old_block_amax(blocks, dims):
    mag = blocks.abs()
    mag = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag)
    return mag.amax(dim=dims) if mag.numel() else mag.sum(dim=dims)


def old_block_cast_1d(a, fp8_dtype, **options):
    r, c = a.shape
    v = old_padded(a, 1, 128)
    cb = v.shape[1] // 128
    v = v.reshape(r, cb, 128)
    scale = RB.block_scale_from_amax(old_block_amax(v, 2), fp8_dtype, **options)
    data = old_saturating_cast(v * scale.unsqueeze(-1), fp8_dtype).reshape(r, cb * 128)[:, :c]
    scale_inv = torch.zeros(cb, round_up(r, 4), dtype=torch.float32)
    scale_inv[:, :r] = RB.reciprocal_elementwise(scale).t()
    return data.contiguous(), scale_inv


def old_block_cast_2d(a, fp8_dtype, **options):
    r, c = a.shape
    v = old_padded(a, 128, 128)
    rb, cb = v.shape[0] // 128, v.shape[1] // 128
    blocks = v.reshape(rb, 128, cb, 128)
    scale = RB.block_scale_from_amax(old_block_amax(blocks, (1, 3)), fp8_dtype, **options)
    scaled = blocks * scale.reshape(rb, 1, cb, 1)
    data = old_saturating_cast(scaled, fp8_dtype).reshape(rb * 128, cb * 128)[:r, :c]
    scale_inv = torch.zeros(rb, round_up(cb, 4), dtype=torch.float32)
    scale_inv[:, :cb] = RB.reciprocal_elementwise(scale)
    return data.contiguous(), scale_inv


def old_mxfp8_cast(a, fp8_dtype, two_d=False):
    r, c = a.shape
    rows = 32 if two_d else 1
    v = old_padded(a, rows, 32)
    rb, cb = v.shape[0] // rows, v.shape[1] // 32
    blocks = v.reshape(rb, rows, cb, 32)
    e = RB.mxfp8_scale_exponent(old_block_amax(blocks, (1, 3)), fp8_dtype)
    scaled = blocks * RB._e8m0_multiplier(e).reshape(rb, 1, cb, 1)
    data = old_saturating_cast(scaled, fp8_dtype).reshape(rb * rows, cb * 32)[:r, :c]
    return data.contiguous(), e


# ---- inputs -------------------------------------------------------------------------------


def special_values():
    """NaN, +-Inf, +-0, subnormals, values at and beyond both FP8 maxima, float32 extremes."""
    values = [float("nan"), float("inf"), 0.0, 1e-40, 1e-45, 2.0**-126, 65504.0, 3.0e38]
    values += [448.0, 449.0, 464.0, 57344.0, 61440.0, 1e6, 2.0**-9, 2.0**-16, 1.0625, 240.0]
    return torch.tensor(values + [-v for v in values], dtype=torch.float64)


def inputs(dtype, seed):
    """Shapes with and without padding, contiguous and transposed, random magnitudes, blocks
    with NaN / Inf / only zeros / only tiny values, and empty matrices."""
    g = torch.Generator().manual_seed(seed)

    def rand(rows, cols, magnitude=1.0):
        return torch.randn(rows, cols, generator=g, dtype=torch.float64) * magnitude

    out = [rand(256, 384).to(dtype), rand(129, 257, 300.0).to(dtype), rand(1, 5).to(dtype)]
    out.append(rand(300, 200, 1e-3).to(dtype).t())  # a transposed view (the column-wise cast)
    mixed = rand(160, 288, 100.0)
    flat = mixed.reshape(-1)
    specials = special_values()
    flat[torch.randperm(flat.numel(), generator=g)[: specials.numel()]] = specials
    out.append(mixed.to(dtype))
    with_inf = rand(64, 256)
    with_inf[3, 7] = float("inf")  # Inf but no NaN: the scale 0 makes NaN bytes
    out.append(with_inf.to(dtype))
    zeros = torch.zeros(40, 256, dtype=dtype)
    zeros[:20] = zeros[:20].neg()  # -0.0 rows
    zeros[30, 200] = 1e-30 if dtype == torch.float32 else 1e-7  # one tiny block
    out.append(zeros)
    out += [torch.zeros(0, 128, dtype=dtype), torch.zeros(7, 0, dtype=dtype)]
    return out


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    assert torch.equal(a.contiguous().view(view), b.contiguous().view(view))


OPTIONS = [
    {},
    {"force_pow_2_scales": False},
    {"epsilon": 1e-3, "force_pow_2_scales": False, "value_for_inf": 65504.0},
]


# ---- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("two_d", [False, True], ids=["1x128", "128x128"])
def test_float8_block_cast_gives_the_former_bytes_and_scales(fp8_dtype, dtype, two_d):
    new, old = (
        (RB.block_cast_2d, old_block_cast_2d) if two_d else (RB.block_cast_1d, old_block_cast_1d)
    )
    for seed in range(2):
        for a in inputs(dtype, seed):
            before = a.clone()
            for options in OPTIONS:
                data, scale_inv = new(a, fp8_dtype, **options)
                expected_data, expected_scale_inv = old(a, fp8_dtype, **options)
                same_bits(data, expected_data)
                same_bits(scale_inv, expected_scale_inv)
            same_bits(a, before)  # the input is never written, float32 included


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("two_d", [False, True], ids=["1x32", "32x32"])
def test_mxfp8_cast_gives_the_former_bytes_and_exponents(fp8_dtype, dtype, two_d):
    for seed in range(2):
        for a in inputs(dtype, seed):
            before = a.clone()
            data, exponents = RB.mxfp8_cast(a, fp8_dtype, two_d=two_d)
            expected_data, expected_exponents = old_mxfp8_cast(a, fp8_dtype, two_d=two_d)
            same_bits(data, expected_data)
            same_bits(exponents, expected_exponents)
            same_bits(a, before)


@pytest.mark.parametrize("out_dtype", INPUT_DTYPES)
def test_block_dequantize_is_upcast_times_scale(out_dtype):
    # The in-place scaling of the upcast: the former "fp8 * scale_inv" product, rounded once.
    g = torch.Generator().manual_seed(3)
    a = torch.randn(130, 300, generator=g) * 50
    for cast, dequantize, rows in (
        (RB.block_cast_1d, RB.block_dequantize_1d, 1),
        (RB.block_cast_2d, RB.block_dequantize_2d, 128),
    ):
        data, scale_inv = cast(a, torch.float8_e4m3fn, force_pow_2_scales=False)
        per_block = scale_inv.t() if rows == 1 else scale_inv
        r, c = data.shape
        s = per_block[: -(-r // rows), : -(-c // 128)]
        expanded = s.repeat_interleave(rows, 0)[:r].repeat_interleave(128, 1)[:, :c]
        expected = (data.float() * expanded).to(out_dtype)
        same_bits(dequantize(data, scale_inv, out_dtype), expected)
