"""Independent FP8 arithmetic for expected values: an oracle that shares no code with the package.

On CPU every kernel wrapper runs ``transformer_engine.pytorch.reference``, so a CPU test that
takes its expected values from the reference compares the reference with itself. The functions
here are written from the numerics contract instead (docs/numerics.md): per-element Python
float math (``struct`` rounding to float32, an explicit FP8 encoder) for the casts, float64
torch math for sums. tests/pytorch/kernels/test_reference_numerics.py checks the reference
against this oracle and hand-computed constants.

Contract, in short: a cast rounds ``x * scale`` to float32, saturates to the largest finite
FP8 value, rounds to nearest even and writes NaN as 0x7F; amax ignores NaN; ``scale_inv`` is
the float32 ``1 / scale``; dequantization rounds ``fp8 * scale_inv`` to float32, then to the
output dtype.
"""

from __future__ import annotations

import math
import struct

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLT_MAX = 3.4028234663852886e38
INF, NAN = math.inf, math.nan

# mantissa bits, exponent bias, largest finite value, its byte
FP8_FORMATS = {E4M3: (3, 7, 448.0, 0x7E), E5M2: (2, 15, 57344.0, 0x7B)}


def torch_fp8(fp8_dtype) -> torch.dtype:
    """``torch.float8_*`` for a torch dtype or a ``DType``-like value (by its name)."""
    if fp8_dtype in FP8_FORMATS:
        return fp8_dtype
    return E4M3 if "E4M3" in str(fp8_dtype).upper() else E5M2


def f32(x: float) -> float:
    """Round a Python float to float32 (round to nearest even, overflow to inf)."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(INF, x)


def fp8_encode(v: float, dtype) -> int:
    """Saturating, round-to-nearest-even encoding of a float32 value; NaN -> 0x7F."""
    mbits, bias, vmax, maxbyte = FP8_FORMATS[dtype]
    if math.isnan(v):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a >= vmax:
        return sign | maxbyte
    if a == 0:
        return sign
    emin = 1 - bias
    e = max(math.frexp(a)[1] - 1, emin)
    r = round(a / 2.0 ** (e - mbits))  # exact quotient; round() is half-to-even
    if r == 2 ** (mbits + 1):
        e, r = e + 1, 2**mbits
    if r < 2**mbits:  # subnormal (or zero)
        return sign | r
    return sign | ((e + bias) << mbits) | (r - 2**mbits)


def fp8_decode(b: int, dtype) -> float:
    """The value of one FP8 byte."""
    mbits, bias, _, _ = FP8_FORMATS[dtype]
    ebits = 7 - mbits
    sign = -1.0 if b & 0x80 else 1.0
    exp = (b >> mbits) & ((1 << ebits) - 1)
    mant = b & ((1 << mbits) - 1)
    if dtype == E4M3 and exp == 15 and mant == 7:
        return NAN
    if dtype == E5M2 and exp == 31:
        return sign * INF if mant == 0 else NAN
    if exp == 0:
        return sign * mant * 2.0 ** (1 - bias - mbits)
    return sign * (1 + mant / 2**mbits) * 2.0 ** (exp - bias)


# ---------------------------------------------------------------- tensor-level expectations


def cast_bytes(x: torch.Tensor, scale, fp8_dtype) -> torch.Tensor:
    """The ``uint8`` bytes of the saturating cast of ``x * scale`` (same shape as ``x``)."""
    dtype = torch_fp8(fp8_dtype)
    s = float(torch.as_tensor(scale).reshape(()))
    values = x.detach().cpu().double().reshape(-1).tolist()  # exact for every input dtype
    encoded = [fp8_encode(f32(v * s), dtype) for v in values]
    return torch.tensor(encoded, dtype=torch.uint8).reshape(x.shape).to(x.device)


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` (NaN ignored, 0 for an empty tensor) as a float32 ``[1]`` tensor."""
    values = [abs(v) for v in x.detach().cpu().double().reshape(-1).tolist() if not math.isnan(v)]
    return torch.tensor([max(values, default=0.0)], dtype=torch.float32)


def reciprocal(scale) -> torch.Tensor:
    """The float32 ``1 / scale`` as a ``[1]`` tensor (float64 division, then one rounding,
    which gives the correctly rounded float32 quotient)."""
    return torch.tensor([f32(1.0 / float(torch.as_tensor(scale).reshape(())))], dtype=torch.float32)


def dequantize(data: torch.Tensor, scale_inv, out_dtype: torch.dtype, fp8_dtype) -> torch.Tensor:
    """Values of FP8 ``data`` (bytes or FP8-typed): ``fp8 * scale_inv`` rounded to float32,
    then to ``out_dtype``."""
    dtype = torch_fp8(fp8_dtype)
    s = float(torch.as_tensor(scale_inv).reshape(()))
    codes = data.detach().cpu().view(torch.uint8).reshape(-1).tolist()
    values = [f32(fp8_decode(b, dtype) * s) for b in codes]
    return torch.tensor(values, dtype=torch.float32).reshape(data.shape).to(out_dtype)


def transpose_last_dim_first(t: torch.Tensor) -> torch.Tensor:
    """``(..., last) -> (last, ...)`` (the column-wise layout), compared as bytes."""
    if t.dtype in FP8_FORMATS:
        t = t.view(torch.uint8)
    return t.movedim(-1, 0).contiguous()


def scale_from_amax(amax_value, fp8_dtype, epsilon: float = 0.0, pow2: bool = False):
    """Current scaling's scale as a float32 ``[1]`` tensor: ``fp8_max / max(amax, eps)``, 1 for
    a zero, infinite or NaN amax, FLT_MAX instead of +inf, rounded down to a power of 2 when
    ``pow2``."""
    fp8_max = FP8_FORMATS[torch_fp8(fp8_dtype)][2]
    a = float(torch.as_tensor(amax_value).reshape(()))
    eps = f32(float(epsilon))
    if not math.isnan(a) and a < eps:
        a = eps
    if a == 0 or math.isinf(a) or math.isnan(a):
        s = 1.0
    else:
        s = f32(fp8_max / a)
        if s == INF:
            s = FLT_MAX
    if pow2:
        s = 2.0 ** (math.frexp(s)[1] - 1)
    return torch.tensor([s], dtype=torch.float32)


def column_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over every dimension but the last, in float64, rounded to ``x``'s dtype (the
    float32-accumulating kernels agree with it within float32 rounding, not bit for bit)."""
    return x.detach().double().reshape(-1, x.shape[-1]).sum(dim=0).to(x.dtype)


# ---------------------------------------------------------------- delayed scaling


def delayed_scaling_update_model(hists, scales, fp8_max, margin=0.0, algo="max", reduced=None):
    """Loop-based delayed-scaling update over lists of plain floats (in place)."""
    scaled_max = f32(fp8_max * 2.0 ** (-margin))
    offset = 0
    for hist, scale in zip(hists, scales):
        n, L = len(scale), len(hist)
        for i in range(n):
            a = hist[0][i]
            if reduced is not None and reduced[offset + i] != 0:
                a = reduced[offset + i]
            if a == 0:
                continue
            cand = a
            if algo == "max":
                for r in range(1, L):
                    h = hist[r][i]
                    cand = NAN if (math.isnan(h) or math.isnan(cand)) else max(cand, h)
            col = [hist[r][i] for r in range(1, L)] + [a]
            col[0] = 0.0
            for r in range(L):
                hist[r][i] = col[r]
            if math.isfinite(cand) and cand > 0:
                s = f32(scaled_max / cand)  # correctly rounded float32 division
                scale[i] = FLT_MAX if s == INF else s
        offset += n
