"""A hand-written float64 oracle of the FP8 block cast (Float8BlockScaling), for the tests.

Written independently of ``transformer_engine.pytorch.reference``: an explicit loop over the
blocks of a small matrix, the scale formula from the specification, float64 arithmetic rounded
to float32 where the kernels compute in float32 (a float64 quotient or product of two float32
values rounds to the same float32 as the float32 operation: 53 >= 2 * 24 + 2 bits).
"""

from __future__ import annotations

import math

import torch

BLOCK = 128
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _f32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def oracle_scale(amax: float, fp8_dtype, *, pow2: bool, eps: float = 0.0, inf_value=None):
    """A block's scale: ``fp8_max / max(amax, eps)``; inf -> ``inf_value``; pow-2 rounds down;
    amax 0 -> 1."""
    a = max(amax, eps)
    if a == 0:
        return 1.0
    if math.isinf(a):
        return 0.0
    scale = _f32(FP8_MAX[fp8_dtype] / a)
    if math.isinf(scale):
        scale = inf_value if inf_value is not None else torch.finfo(torch.float32).max
    if pow2 and scale > 0:
        scale = 2.0 ** math.floor(math.log2(scale))
    return scale


def oracle_cast(a: torch.Tensor, fp8_dtype, *, two_d: bool, pow2: bool, eps: float = 0.0):
    """``(values float64 [R, C] = FP8 values as numbers, scales dict (block row, block col) ->
    scale)`` of the matrix ``a``: 1x128 tiles along C, or 128x128 blocks."""
    r, c = a.shape
    x = a.double()
    limit = FP8_MAX[fp8_dtype]
    values = torch.zeros(r, c, dtype=torch.float64)
    scales = {}
    rows_per = BLOCK if two_d else 1
    inf_value = torch.finfo(a.dtype).max
    for i0 in range(0, r, rows_per):
        for j0 in range(0, c, BLOCK):
            block = x[i0 : i0 + rows_per, j0 : j0 + BLOCK]
            mag = block.abs()
            mag = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag)
            amax = float(mag.max()) if mag.numel() else 0.0
            s = oracle_scale(amax, fp8_dtype, pow2=pow2, eps=eps, inf_value=inf_value)
            scales[(i0 // rows_per, j0 // BLOCK)] = s
            scaled = (block * s).float().double().clamp(-limit, limit)  # float32 product
            q = scaled.float().to(fp8_dtype).double()
            values[i0 : i0 + rows_per, j0 : j0 + BLOCK] = q
    return values, scales


def oracle_dequantize(a: torch.Tensor, fp8_dtype, *, two_d: bool, pow2: bool, eps: float = 0.0):
    """float64 ``FP8 value / scale`` per block: what the cast of ``a`` dequantizes to."""
    values, scales = oracle_cast(a, fp8_dtype, two_d=two_d, pow2=pow2, eps=eps)
    out = values.clone()
    rows_per = BLOCK if two_d else 1
    for (bi, bj), s in scales.items():
        block = out[bi * rows_per : (bi + 1) * rows_per, bj * BLOCK : (bj + 1) * BLOCK]
        block.mul_(_f32(1.0 / s) if s != 0 else math.inf)
    return out
