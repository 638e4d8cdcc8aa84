"""A hand-written float64 oracle of the MXFP8 cast, for the tests.

Written independently of ``transformer_engine.pytorch.reference``: an explicit loop over the
32-element blocks of a small matrix. The E8M0 exponent follows upstream's ``float_to_e8m0``
applied to ``q = float32(amax * float32(1 / fp8_max))`` (a float64 product of two float32 values
rounds to the same float32 as the float32 product): the biased exponent of ``q``, plus one when
``q``'s mantissa is non-zero, except at exponent 254 and for denormals ``<= 2^-127``. Bytes
come from ``fp8_oracle.fp8_encode`` (round to nearest even, saturating).
"""

from __future__ import annotations

import math

import torch
from fp8_oracle import f32, fp8_decode, fp8_encode

BLOCK = 32
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def oracle_exponent(amax: float, fp8_dtype) -> int:
    """The E8M0 byte of a block with this amax."""
    q = f32(amax * f32(1.0 / FP8_MAX[fp8_dtype]))
    if q == 0:
        return 0
    if math.isinf(q):
        return 254
    if q < 2.0**-126:  # denormal: exponent field 0, mantissa q / 2^-149
        mantissa = int(q / 2.0**-149)
        return 0 if mantissa <= 0x400000 else 1
    frac, power = math.frexp(q)  # q = frac * 2^power, frac in [0.5, 1)
    biased = power - 1 + 127
    if frac != 0.5 and biased != 254:
        biased += 1
    return biased


def _multiplier(e: int) -> float:
    return 1.0 if e == 0 else 2.0 ** (127 - e)


def oracle_cast(a: torch.Tensor, fp8_dtype, *, two_d: bool = False):
    """``(bytes uint8 [R, C], exponents)`` of the matrix ``a``: 1x32 blocks along C
    (exponents ``[R, ceil(C/32)]``), or 32x32 blocks (``[ceil(R/32), ceil(C/32)]``)."""
    r, c = a.shape
    x = a.double().tolist()
    rows = BLOCK if two_d else 1
    rb, cb = -(-r // rows), -(-c // BLOCK)
    out = torch.zeros(r, c, dtype=torch.uint8)
    exps = torch.zeros(rb, cb, dtype=torch.uint8)
    for bi in range(rb):
        for bj in range(cb):
            cells = [
                (i, j)
                for i in range(bi * rows, min(r, (bi + 1) * rows))
                for j in range(bj * BLOCK, min(c, (bj + 1) * BLOCK))
            ]
            mags = [abs(x[i][j]) for i, j in cells if not math.isnan(x[i][j])]
            e = oracle_exponent(max(mags, default=0.0), fp8_dtype)
            exps[bi, bj] = e
            for i, j in cells:
                out[i, j] = fp8_encode(f32(x[i][j] * _multiplier(e)), fp8_dtype)
    return out, exps


def oracle_dequantize(a: torch.Tensor, fp8_dtype, *, columnwise: bool = False, two_d=False):
    """float64 values of the MXFP8 copy of ``a [R, C]`` (row-wise: blocks along C;
    column-wise: blocks along R)."""
    src = a.t() if columnwise and not two_d else a
    data, exps = oracle_cast(src, fp8_dtype, two_d=two_d)
    rows = BLOCK if two_d else 1
    values = torch.zeros(src.shape, dtype=torch.float64)
    for i in range(src.shape[0]):
        for j in range(src.shape[1]):
            e = int(exps[i // rows, j // BLOCK])
            values[i, j] = fp8_decode(int(data[i, j]), fp8_dtype) * 2.0 ** (e - 127)
    return values.t() if columnwise and not two_d else values
