"""A hand-written NVFP4 oracle, for the tests.

Written independently of ``transformer_engine.pytorch.reference_fp4``: explicit loops over the
16-element blocks of a small matrix, Python floats rounded to float32 after every operation
(``f32``), the E4M3 block scale by ``fp8_oracle.fp8_encode`` and the E2M1 rounding by a search
over the value table written out below. The formulas (docs/numerics.md):

    S_enc = f32(2688 / amax)   (1 when amax == 0 or the quotient is 0 or inf -> float32 max)
    s_b   = e4m3(min(f32(f32(block_amax / 6) * S_enc), 448))
    code  = e2m1(f32(x * f32(S_enc / s_b)))   (0 when s_b == 0)
    value = e2m1 * s_b / S_enc
"""

from __future__ import annotations

import math

import torch
from fp8_oracle import f32, fp8_decode, fp8_encode

BLOCK = 16
E4M3 = torch.float8_e4m3fn
# The E2M1 magnitudes, by code 0..7, written out by hand.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
F32_MAX = float(torch.finfo(torch.float32).max)


def global_scale(amax: float) -> float:
    if amax == 0:
        return 1.0
    s = f32(448.0 * 6.0 / amax)
    s = min(s, F32_MAX)
    return 1.0 if s == 0 else s


def e2m1_code(v: float) -> int:
    """Round-to-nearest-even code of float ``v`` (saturating at 6), sign in bit 3."""
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    mag = min(abs(v), 6.0)
    best = 0
    for code, value in enumerate(E2M1):
        d, d_best = abs(mag - value), abs(mag - E2M1[best])
        if d < d_best or (d == d_best and code % 2 == 0 and best % 2 == 1):
            best = code
    return best | sign


def e2m1_value(code: int) -> float:
    mag = E2M1[code & 7]
    return -mag if code & 8 else mag


def oracle_cast(a: torch.Tensor, amax: float | None = None, *, two_d: bool = False):
    """``(codes uint8 [R, C] unpacked, scale bytes, amax)`` of the float matrix ``a``: 1x16
    blocks along C (scales ``[R, ceil(C/16)]``) or 16x16 blocks (``[ceil(R/16), ceil(C/16)]``)."""
    r, c = a.shape
    x = a.double().tolist()
    if amax is None:
        amax = max((abs(v) for row in x for v in row if not math.isnan(v)), default=0.0)
    s_enc = global_scale(amax)
    rows = BLOCK if two_d else 1
    rb, cb = -(-r // rows), -(-c // BLOCK)
    codes = torch.zeros(r, c, dtype=torch.uint8)
    scales = torch.zeros(rb, cb, dtype=torch.uint8)
    for bi in range(rb):
        for bj in range(cb):
            cells = [
                (i, j)
                for i in range(bi * rows, min(r, (bi + 1) * rows))
                for j in range(bj * BLOCK, min(c, (bj + 1) * BLOCK))
            ]
            block_amax = max((abs(x[i][j]) for i, j in cells), default=0.0)
            byte = fp8_encode(min(f32(f32(block_amax / 6.0) * s_enc), 448.0), E4M3)
            scales[bi, bj] = byte
            s_b = fp8_decode(byte, E4M3)
            enc = 0.0 if s_b == 0 else min(f32(s_enc / s_b), F32_MAX)
            for i, j in cells:
                codes[i, j] = e2m1_code(f32(x[i][j] * enc))
    return codes, scales, amax


def oracle_values(codes: torch.Tensor, scales: torch.Tensor, amax: float, *, two_d=False):
    """float64 values ``e2m1 * s_b / S_enc`` of oracle codes and scales."""
    s_enc = global_scale(amax)
    rows = BLOCK if two_d else 1
    out = torch.zeros(codes.shape, dtype=torch.float64)
    for i in range(codes.shape[0]):
        for j in range(codes.shape[1]):
            s_b = fp8_decode(int(scales[i // rows, j // BLOCK]), E4M3)
            out[i, j] = e2m1_value(int(codes[i, j])) * s_b / s_enc
    return out


def oracle_pack(codes: torch.Tensor) -> torch.Tensor:
    """Bytes of codes ``[R, C]``: element 2k in the low nibble, 2k+1 in the high one."""
    r, c = codes.shape
    out = torch.zeros(r, (c + 1) // 2, dtype=torch.uint8)
    for i in range(r):
        for j in range(c):
            out[i, j // 2] |= int(codes[i, j]) << (4 * (j % 2))
    return out


def hadamard16() -> torch.Tensor:
    """Sylvester's 16x16 Hadamard matrix by doubling ``[[1]]``, float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def oracle_rht(a: torch.Tensor, signs) -> torch.Tensor:
    """float64 RHT of each full 16-block of every row of ``a``: ``v -> H diag(signs) v / 4``."""
    m = hadamard16() * torch.tensor(signs, dtype=torch.float64) / 4
    out = a.double().clone()
    full = (a.shape[1] // BLOCK) * BLOCK
    for i in range(a.shape[0]):
        for j in range(0, full, BLOCK):
            out[i, j : j + BLOCK] = m @ out[i, j : j + BLOCK]
    return out


def oracle_dequantize(a: torch.Tensor, *, columnwise=False, two_d=False, rht_signs=None):
    """float64 values of one NVFP4 copy of ``a [R, C]`` as the GEMM multiplies it (row-wise:
    blocks along C; column-wise: blocks along R, after the RHT when ``rht_signs`` is given,
    whose amax is then taken after the RHT), in ``a``'s orientation."""
    src = a.t() if columnwise and not two_d else a
    if rht_signs is not None:
        src = oracle_rht(src, rht_signs).float()
    codes, scales, amax = oracle_cast(src, two_d=two_d)
    values = oracle_values(codes, scales, amax, two_d=two_d)
    return values.t() if columnwise and not two_d else values
