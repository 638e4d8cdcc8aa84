"""Numerics of transformer_engine.pytorch.reference against independent expected values.

Expected values are hand-computed constants or come from the small per-element
Python implementations in tests/pytorch/fp8_oracle.py and below (struct/float math); the
reference is never used to check itself.
"""

from __future__ import annotations

import math
import random
import struct
import zlib

import pytest
import torch
from fp8_oracle import E4M3, E5M2, FLT_MAX, FP8_FORMATS, INF, NAN, f32, fp8_decode, fp8_encode
from fp8_oracle import delayed_scaling_update_model as model_update

from transformer_engine.pytorch import reference as R

FP8 = (E4M3, E5M2)
HP = (torch.float32, torch.float16, torch.bfloat16)

# ---------------------------------------------------------------- independent helpers


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f16(x: float) -> float:
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        return struct.unpack("<e", struct.pack("<e", x))[0]
    except OverflowError:
        return math.copysign(INF, x)


def bf16(x: float) -> float:
    """float32 value -> bfloat16 (round to nearest even) via the bit pattern."""
    if math.isnan(x):
        return x
    bits = f32_bits(x)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def round_to(x: float, dtype: torch.dtype) -> float:
    return {torch.float32: f32, torch.float16: f16, torch.bfloat16: bf16}[dtype](x)


def bytes_of(t: torch.Tensor) -> list:
    return t.view(torch.uint8).reshape(-1).tolist()


def cast(values, scale, dtype, in_dtype=torch.float32):
    x = torch.tensor(values, dtype=torch.float32).to(in_dtype)
    return R.cast_to_fp8(x, torch.tensor([scale], dtype=torch.float32), dtype)


def test_independent_codec_roundtrips_every_byte():
    # Sanity of the helpers themselves: every finite fp8 value encodes to its own byte.
    for dtype in FP8:
        for b in range(256):
            v = fp8_decode(b, dtype)
            if math.isfinite(v):
                assert fp8_encode(v, dtype) == b, (dtype, b)


# ---------------------------------------------------------------- saturating cast

HAND_CASES = [
    # (dtype, value, byte)
    (E4M3, 1.0, 0x38), (E4M3, -1.0, 0xB8), (E4M3, 448.0, 0x7E), (E4M3, -448.0, 0xFE),
    (E4M3, 449.0, 0x7E), (E4M3, 464.0, 0x7E), (E4M3, 1e6, 0x7E), (E4M3, -1e30, 0xFE),
    (E4M3, INF, 0x7E), (E4M3, -INF, 0xFE), (E4M3, 0.0, 0x00), (E4M3, -0.0, 0x80),
    (E4M3, 1.0625, 0x38), (E4M3, 1.1875, 0x3A), (E4M3, 432.0, 0x7E), (E4M3, 400.0, 0x7C),
    (E4M3, 2.0**-9, 0x01), (E4M3, -(2.0**-9), 0x81), (E4M3, 2.0**-10, 0x00),
    (E4M3, 3 * 2.0**-10, 0x02), (E4M3, 7 * 2.0**-9, 0x07), (E4M3, 2.0**-6, 0x08),
    (E4M3, 15 * 2.0**-10, 0x08), (E4M3, 2.0**-11, 0x00), (E4M3, -(2.0**-11), 0x80),
    (E5M2, 1.0, 0x3C), (E5M2, 57344.0, 0x7B), (E5M2, -57344.0, 0xFB), (E5M2, 61440.0, 0x7B),
    (E5M2, 1e9, 0x7B), (E5M2, INF, 0x7B), (E5M2, -INF, 0xFB), (E5M2, -0.0, 0x80),
    (E5M2, 1.125, 0x3C), (E5M2, 1.375, 0x3E), (E5M2, 2.0**-16, 0x01), (E5M2, 2.0**-17, 0x00),
    (E5M2, 3 * 2.0**-17, 0x02), (E5M2, 2.0**-14, 0x04), (E5M2, -(3 * 2.0**-16), 0x83),
]  # fmt: skip


@pytest.mark.parametrize("dtype,value,byte", HAND_CASES)
def test_cast_hand_computed_bytes(dtype, value, byte):
    assert fp8_encode(value, dtype) == byte  # the helper agrees with the hand value
    out = cast([value], 1.0, dtype)
    assert out.dtype == dtype
    assert bytes_of(out) == [byte]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("in_dtype", HP)
def test_nan_becomes_canonical_0x7f(dtype, in_dtype):
    payload = struct.unpack("<f", struct.pack("<I", 0xFFC00123))[0]  # negative NaN with payload
    x = torch.tensor([NAN, -NAN, payload, 1.0], dtype=torch.float32).to(in_dtype)
    out = R.cast_to_fp8(x, torch.tensor([1.0]), dtype)
    assert torch.equal(
        out.view(torch.uint8),
        torch.tensor([0x7F, 0x7F, 0x7F, fp8_encode(1.0, dtype)], dtype=torch.uint8),
    )


@pytest.mark.parametrize("dtype", FP8)
def test_nan_from_the_product(dtype):
    # inf * 0 and 0 * inf are NaN in float32 -> canonical NaN, not a saturated value.
    x = torch.tensor([INF, 0.0])
    assert bytes_of(R.cast_to_fp8(x[:1], torch.tensor([0.0]), dtype)) == [0x7F]
    assert bytes_of(R.cast_to_fp8(x[1:], torch.tensor([INF]), dtype)) == [0x7F]


@pytest.mark.parametrize("dtype", FP8)
def test_every_finite_fp8_value_casts_to_itself(dtype):
    values = [fp8_decode(b, dtype) for b in range(256)]
    keep = [b for b, v in enumerate(values) if math.isfinite(v)]
    out = cast([values[b] for b in keep], 1.0, dtype)
    assert bytes_of(out) == keep


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("in_dtype", HP)
@pytest.mark.parametrize("scale", [1.0, 0.37, 3000.5, 2.0**-10, 1e-30])
def test_cast_matches_independent_encoder(dtype, in_dtype, scale):
    rng = random.Random(zlib.crc32(f"{dtype}-{in_dtype}-{scale}".encode()))
    vals = [
        rng.choice((-1, 1)) * rng.uniform(1, 2) * 2.0 ** rng.randint(-24, 24) for _ in range(400)
    ]
    vals += [0.0, -0.0, INF, -INF, 65504.0, -65504.0]
    x = torch.tensor(vals, dtype=torch.float32).to(in_dtype)
    s = f32(scale)
    expected = [fp8_encode(f32(xv * s), dtype) for xv in x.float().tolist()]
    out = R.cast_to_fp8(x, torch.tensor([scale], dtype=torch.float32), dtype)
    assert out.shape == x.shape and out.dtype == dtype
    assert bytes_of(out) == expected


def test_product_is_rounded_to_float32_before_the_fp8_rounding():
    # x*scale = 1.0625 + 2**-27 - 2**-46 exactly; in float32 that is the midpoint 1.0625,
    # which rounds to even (1.0, 0x38). Rounding the exact product would give 1.125 (0x39).
    x = 1 + 2.0**-23
    scale = 1.0625 - 2.0**-23
    assert f32(x) == x and f32(scale) == scale
    assert fp8_encode(x * scale, E4M3) == 0x39  # exact product would round up
    assert bytes_of(cast([x], scale, E4M3)) == [0x38]


@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_saturate(in_dtype):
    big = 65504.0 if in_dtype == torch.float16 else 3.0e38
    x = torch.tensor([big, -big, INF, -INF], dtype=in_dtype)
    assert bytes_of(R.cast_to_fp8(x, torch.tensor([1.0]), E4M3)) == [0x7E, 0xFE, 0x7E, 0xFE]
    assert bytes_of(R.cast_to_fp8(x, torch.tensor([1.0]), E5M2)) == [0x7B, 0xFB, 0x7B, 0xFB]


def test_cast_keeps_shape_and_accepts_0d_scale():
    x = torch.linspace(-3, 3, 24).reshape(2, 3, 4)
    out = R.cast_to_fp8(x, torch.tensor(2.0), E4M3)
    assert out.shape == (2, 3, 4) and out.dtype == E4M3
    assert bytes_of(out) == [fp8_encode(f32(v * 2.0), E4M3) for v in x.reshape(-1).tolist()]


# ---------------------------------------------------------------- amax


@pytest.mark.parametrize("in_dtype", HP)
def test_amax_values(in_dtype):
    x = torch.tensor([[1.0, -7.5], [3.0, NAN]], dtype=in_dtype)
    a = R.amax(x)
    assert a.dtype == torch.float32 and a.shape == (1,)
    assert a.item() == 7.5


def test_amax_is_of_the_unscaled_input_and_inf_counts():
    assert R.amax(torch.tensor([1.0, -INF, NAN])).item() == INF
    assert R.amax(torch.tensor([NAN, NAN])).item() == 0.0
    assert R.amax(torch.tensor([-1e38, 5.0])).item() == f32(1e38)
    assert R.amax(torch.tensor([-0.0])).item() == 0.0


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2)])
def test_amax_of_empty_is_zero(shape):
    a = R.amax(torch.empty(shape))
    assert a.dtype == torch.float32 and a.shape == (1,) and a.item() == 0.0


# ---------------------------------------------------------------- transpose


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4)])
def test_transpose_last_dim_first(shape):
    n = math.prod(shape)
    data = torch.arange(n, dtype=torch.uint8).reshape(shape)
    out = R.transpose_last_dim_first(data.view(E4M3))
    assert out.dtype == E4M3
    last, leading = shape[-1], shape[:-1]
    assert tuple(out.shape) == (last, *leading)
    # element (j, *idx) of the result is data[(*idx, j)]
    flat = out.view(torch.uint8).reshape(last, -1)
    rows = math.prod(leading)
    for j in range(last):
        for r in range(rows):
            assert flat[j, r].item() == (r * last + j) % 256


def test_transpose_of_non_contiguous_fp8():
    data = torch.arange(12, dtype=torch.uint8).reshape(4, 3).t()  # [3, 4], non-contiguous
    out = R.transpose_last_dim_first(data.view(E5M2))
    assert torch.equal(out.view(torch.uint8), torch.arange(12, dtype=torch.uint8).reshape(4, 3))


def test_transpose_0d_raises():
    with pytest.raises(ValueError):
        R.transpose_last_dim_first(torch.zeros((), dtype=torch.uint8).view(E4M3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_transpose_wider_dtypes_never_silently_wrong(dtype):
    # The contract is generic ("data viewed as [rows, last], transposed"): for a
    # multi-byte dtype it must either transpose correctly or refuse, never return garbage.
    x = torch.arange(8, dtype=dtype).reshape(4, 2)
    try:
        out = R.transpose_last_dim_first(x)
    except (TypeError, ValueError, RuntimeError):
        return
    assert torch.equal(out, x.t())


# ---------------------------------------------------------------- reciprocal, dequantize


def test_column_sum_hand_values():
    x = torch.tensor([[[1.0, -2.0, 0.5]], [[3.0, 4.0, 0.25]]])  # shape (2, 1, 3)
    assert torch.equal(R.column_sum(x), torch.tensor([4.0, 2.0, 0.75]))
    # Accumulated in float32, rounded once: 256 + 1 + 1 = 258 is a bf16 value (a bf16 running
    # sum would stay at 256: 257 is a tie between 256 and 258 and rounds to even, 256).
    col = torch.tensor([[256.0], [1.0], [1.0]], dtype=torch.bfloat16)
    out = R.column_sum(col)
    assert out.dtype == torch.bfloat16 and out.item() == 258.0
    with pytest.raises(ValueError, match="0-d tensor has no last dimension"):
        R.column_sum(torch.tensor(1.0))


@pytest.mark.parametrize("s", [1.0, 3.0, 0.1, 448.0 / 3, 2.0**-20, FLT_MAX, 0.0])
def test_reciprocal(s):
    r = R.reciprocal(torch.tensor(s, dtype=torch.float32))
    assert r.dtype == torch.float32 and r.shape == (1,)
    expected = INF if s == 0 else f32(1.0 / f32(s))
    assert r.item() == expected


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("out_dtype", HP)
@pytest.mark.parametrize("scale_inv", [1.0, 1 + 3 * 2.0**-9, 0.3, 7.1e-5, 5000.0])
def test_dequantize_matches_independent(dtype, out_dtype, scale_inv):
    codes = [b for b in range(256) if not math.isnan(fp8_decode(b, dtype))]
    data = torch.tensor(codes, dtype=torch.uint8).view(dtype)
    s = f32(scale_inv)
    out = R.dequantize(data, torch.tensor([scale_inv]), out_dtype)
    assert out.dtype == out_dtype and out.shape == data.shape
    # fp8 * float32 is exact in double; round once to float32, then once to out_dtype
    expected = [round_to(f32(fp8_decode(b, dtype) * s), out_dtype) for b in codes]
    assert torch.equal(out, torch.tensor(expected, dtype=torch.float32).to(out_dtype))


def test_dequantize_single_rounding_hand_value():
    # 1.5 * (1 + 3*2**-9) = 1.5087890625 (exact in float32) -> bf16 1.5078125.
    # Rounding scale_inv to bf16 first would give 1.5 * 1.0078125 -> 1.515625.
    data = torch.tensor([0x3C], dtype=torch.uint8).view(E4M3)  # 1.5
    out = R.dequantize(data, torch.tensor([1 + 3 * 2.0**-9]), torch.bfloat16)
    assert out.item() == 1.5078125
    out32 = R.dequantize(data, torch.tensor([1 + 3 * 2.0**-9]), torch.float32)
    assert out32.item() == 1.5087890625


def test_dequantize_nan_and_overflow():
    data = torch.tensor([0x7F, 0xFF], dtype=torch.uint8).view(E4M3)
    assert torch.isnan(R.dequantize(data, torch.tensor([1.0]), torch.float32)).all()
    big = torch.tensor([0x7B], dtype=torch.uint8).view(E5M2)  # 57344
    assert R.dequantize(big, torch.tensor([2.0]), torch.float16).item() == INF
    assert R.dequantize(big, torch.tensor([2.0]), torch.float32).item() == 114688.0


# ---------------------------------------------------------------- compute_scale_from_amax


def scale_of(amax, dtype=E4M3, **kw):
    s = R.compute_scale_from_amax(torch.tensor([amax], dtype=torch.float32), dtype, **kw)
    assert s.dtype == torch.float32 and s.shape == (1,)
    return s.item()


@pytest.mark.parametrize("amax", [0.0, INF, NAN, -INF])
@pytest.mark.parametrize("dtype", FP8)
def test_scale_degenerate_amax_gives_one(amax, dtype):
    assert scale_of(amax, dtype) == 1.0
    assert scale_of(amax, dtype, force_pow_2_scales=True) == 1.0


@pytest.mark.parametrize(
    "dtype,amax,expected",
    [(E4M3, 2.0, 224.0), (E4M3, 448.0, 1.0), (E4M3, 896.0, 0.5), (E5M2, 2.0, 28672.0),
     (E5M2, 57344.0, 1.0), (E4M3, 3.0, f32(448 / 3)), (E5M2, 0.1, f32(57344 / f32(0.1)))],
)  # fmt: skip
def test_scale_normal(dtype, amax, expected):
    assert scale_of(amax, dtype) == expected


def test_scale_epsilon_clamp():
    assert scale_of(1e-3, epsilon=1.0) == 448.0
    assert scale_of(0.0, epsilon=2.0) == 224.0  # clamped before the zero check
    assert scale_of(4.0, epsilon=2.0) == 112.0  # amax above epsilon: untouched
    assert scale_of(NAN, epsilon=1.0) == 1.0  # NaN is not < eps: passes through
    assert scale_of(1e-5, epsilon=1e-3) == f32(448 / f32(1e-3))


@pytest.mark.parametrize("dtype,amax", [(E4M3, 2.0**-149), (E4M3, 1e-37), (E5M2, 1e-36)])
def test_scale_tiny_amax_gives_flt_max(dtype, amax):
    assert scale_of(amax, dtype) == FLT_MAX
    assert scale_of(amax, dtype, force_pow_2_scales=True) == 2.0**127


@pytest.mark.parametrize(
    "dtype,amax,expected",
    [(E4M3, 3.0, 128.0), (E4M3, 2.0, 128.0), (E4M3, 448.0, 1.0), (E4M3, 1e-3, 2.0**18),
     (E4M3, 500.0, 0.5), (E5M2, 3.0, 16384.0), (E5M2, 1e6, 2.0**-5)],
)  # fmt: skip
def test_scale_force_pow_2_rounds_down(dtype, amax, expected):
    assert scale_of(amax, dtype, force_pow_2_scales=True) == expected


def test_scaled_fp8_max():
    assert R.scaled_fp8_max(E4M3, 0) == 448.0
    assert R.scaled_fp8_max(E4M3, 2) == 112.0
    assert R.scaled_fp8_max(E5M2, 0.5) == f32(57344 * 2**-0.5)


# ---------------------------------------------------------------- delayed scaling: independent model


def to_t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def same(t: torch.Tensor, values) -> bool:
    """Bitwise equality (NaN-safe) of a float32 tensor and nested lists of floats."""
    return torch.equal(t.view(torch.int32), to_t(values).view(torch.int32))


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("margin", [0.0, 1.0])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_edge_case_table(dtype, margin, algo):
    fp8_max = FP8_FORMATS[dtype][2]
    row0 = [0.0, 1e-37, 2.0, INF, NAN]
    H = to_t([row0, [0.0] * 5, [0.0] * 5])
    S = to_t([0.5] * 5)
    R.delayed_scaling_update([H], [S], dtype, margin, algo)
    normal = f32(f32(fp8_max * 2.0**-margin) / 2.0)
    assert same(S, [0.5, FLT_MAX, normal, 0.5, 0.5])
    assert normal == fp8_max / 2 / 2**margin
    # slot 0 (amax 0): no roll at all; the others rolled: newest in the last row, row 0 zeroed
    assert same(H, [[0.0] * 5, [0.0] * 5, [0.0, 1e-37, 2.0, INF, NAN]])


def test_zero_amax_keeps_initial_scale_and_history():
    H = to_t([[0.0, 0.0], [3.0, 0.0], [5.0, 1.0]])
    S = to_t([1.0, 1.0])
    R.delayed_scaling_update([H], [S], E4M3)
    assert same(H, [[0.0, 0.0], [3.0, 0.0], [5.0, 1.0]])
    assert same(S, [1.0, 1.0])


@pytest.mark.parametrize("algo,expected_scale", [("max", 28.0), ("most_recent", 896.0)])
def test_roll_and_algo(algo, expected_scale):
    # row 0 = current amax, row 1 = oldest, last row = newest
    H = to_t([[0.5], [16.0], [8.0], [3.0]])
    S = to_t([1.0])
    R.delayed_scaling_update([H], [S], E4M3, 0.0, algo)
    assert same(H, [[0.0], [8.0], [3.0], [0.5]])  # oldest (16) dropped, 0.5 newest
    assert same(S, [expected_scale])  # "max" includes the row that is dropped


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_history_length_one(algo):
    H = to_t([[7.0, 0.0]])
    S = to_t([1.0, 2.0])
    R.delayed_scaling_update([H], [S], E4M3, 0.0, algo)
    assert same(H, [[0.0, 0.0]])
    assert same(S, [64.0, 2.0])


def test_margin_non_integer():
    H = to_t([[3.0], [0.0]])
    S = to_t([1.0])
    R.delayed_scaling_update([H], [S], E5M2, 0.5)
    assert same(S, [f32(f32(57344 * 2**-0.5) / 3.0)])


def test_reduction_buffer_across_histories():
    H1 = to_t([[2.0, 3.0], [0.0, 0.0]])
    H2 = to_t([[1.0, 0.0, 5.0], [0.0, 0.0, 0.0]])
    S1, S2 = to_t([1.0, 1.0]), to_t([1.0, 1.0, 1.0])
    buf = to_t([0.0, 1.0, 0.0, 0.0, 8.0])
    R.delayed_scaling_update([H1, H2], [S1, S2], E4M3, 0.0, "max", buf)
    # a = [2 (own row 0), 1 (buffer, even though smaller), 1 (own), 0 (untouched), 8 (buffer)]
    assert same(H1, [[0.0, 0.0], [2.0, 1.0]])
    assert same(H2, [[0.0, 0.0, 0.0], [1.0, 0.0, 8.0]])
    assert same(S1, [224.0, 448.0])
    assert same(S2, [448.0, 1.0, 56.0])
    assert same(buf, [0.0, 1.0, 0.0, 0.0, 8.0])  # the buffer is read only


def test_max_algo_nan_in_history_keeps_scale_until_dropped():
    H = to_t([[2.0], [NAN], [1.0]])
    S = to_t([3.0])
    R.delayed_scaling_update([H], [S], E4M3, 0.0, "max")
    assert same(S, [3.0])
    assert same(H, [[0.0], [1.0], [2.0]])  # NaN was the oldest and is gone
    H[0, 0] = 4.0
    R.delayed_scaling_update([H], [S], E4M3, 0.0, "max")
    assert same(S, [112.0])
    # most_recent ignores the NaN in older rows
    H2, S2 = to_t([[2.0], [NAN], [NAN]]), to_t([3.0])
    R.delayed_scaling_update([H2], [S2], E4M3, 0.0, "most_recent")
    assert same(S2, [224.0])


def test_reference_rejects_unknown_algo_and_mismatch():
    H, S = to_t([[1.0]]), to_t([1.0])
    with pytest.raises(ValueError, match="amax_compute_algo"):
        R.delayed_scaling_update([H], [S], E4M3, 0.0, "mean")
    with pytest.raises(ValueError, match="1 amax histories but 2 scales"):
        R.delayed_scaling_update([H], [S, S], E4M3)
    assert same(H, [[1.0]]) and same(S, [1.0])


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0.0, 2.0])
@pytest.mark.parametrize("use_buffer", [False, True])
def test_twenty_step_simulation(dtype, algo, margin, use_buffer):
    rng = random.Random(1234 + int(margin) + 7 * use_buffer + (algo == "max"))
    shapes = [(4, 3), (4, 2), (1, 2)]
    hists = [[[0.0] * n for _ in range(L)] for L, n in shapes]
    scales = [[1.0] * n for _, n in shapes]
    H = [to_t(h) for h in hists]
    S = [to_t(s) for s in scales]
    fp8_max = FP8_FORMATS[dtype][2]

    def amax_value():
        kind = rng.random()
        if kind < 0.25:
            return 0.0
        if kind < 0.3:
            return f32(rng.uniform(1, 2) * 1e-38)
        return f32(rng.uniform(1, 2) * 2.0 ** rng.randint(-12, 20))

    for step in range(20):
        for (_L, n), h, ht in zip(shapes, hists, H):
            for i in range(n):
                # simulate casts: max-accumulate into row 0 (a whole zero step now and then)
                v = 0.0 if step % 7 == 3 else amax_value()
                h[0][i] = max(h[0][i], v)
                ht[0, i] = h[0][i]
        reduced = None
        if use_buffer:
            reduced = [f32(max(h[0][i], amax_value())) if rng.random() < 0.5 else 0.0
                       for h, (_, n) in zip(hists, shapes) for i in range(n)]  # fmt: skip
        buf = to_t(reduced) if reduced is not None else None
        model_update(hists, scales, fp8_max, margin, algo, reduced)
        R.delayed_scaling_update(H, S, dtype, margin, algo, buf)
        for h, s, ht, st in zip(hists, scales, H, S):
            assert same(ht, h), f"history differs at step {step}"
            assert same(st, s), f"scale differs at step {step}"
    assert any(s != 1.0 for sc in scales for s in sc)  # the simulation did move scales
