"""Pure-PyTorch NVFP4 cast (``NVFP4BlockScaling``): the exact arithmetic, on every device.

NVFP4 scales twice. A float32 *global* encode scale comes from the amax of the whole tensor,
``S_enc = (448 * 6) / amax`` (E4M3's and E2M1's largest values; clamped to the float32 maximum;
1 when ``amax`` is 0 or ``S_enc`` would be 0, i.e. an infinite amax). Each block of 16 elements
then has an E4M3 *decode* scale

    ``s_b = e4m3(min((block_amax / 6) * S_enc, 448))``   (round to nearest even)

and its values are ``e2m1(x * (S_enc / s_b))`` (0 when ``s_b`` is 0), E2M1 being the eight
magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` with a sign bit, saturating at 6. A value decodes
to ``e2m1 * s_b / S_enc``. All arithmetic is float32, each operation rounded in the order
written. NaN inputs make their block's amax (and so its scale) NaN: the block decodes to NaN.

Rounding is to nearest, ties to the even code (``0.25 -> 0``, ``0.75 -> 1``, ``1.25 -> 1``,
``2.5 -> 2``, ``5 -> 4``), or stochastic: up to the next E2M1 magnitude with probability
``(v - lo) / (hi - lo)``, so the expectation is ``v`` (draws from ``torch.rand`` with the
caller's generator, or the device's default one).

Codes are 4 bits, ``sign << 3 | magnitude index`` (``-0`` keeps its sign bit), packed two per
byte along the last dim: element ``2i`` in the low nibble, ``2i + 1`` in the high nibble; an
odd length leaves the last high nibble 0.

The random Hadamard transform (RHT) multiplies every full 16-element block ``v`` by
``R = H16 * diag(signs) / 4`` (Sylvester's Hadamard matrix, :data:`RHT_SIGNS`), an orthogonal
matrix, so ``R.T @ (R @ v) = v``; a trailing partial block is left as it is.
"""

from __future__ import annotations

import torch

from .utils import round_up_to_nearest_multiple as round_up

__all__ = [
    "NVFP4_BLOCK_LEN",
    "E2M1_MAX",
    "E4M3_MAX",
    "E2M1_VALUES",
    "RHT_SIGNS",
    "global_amax",
    "nvfp4_global_scale",
    "e2m1_encode",
    "e2m1_decode",
    "pack_fp4",
    "unpack_fp4",
    "rht_matrix",
    "apply_rht",
    "nvfp4_cast",
    "nvfp4_dequantize",
]

NVFP4_BLOCK_LEN = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: the E2M1 magnitudes, indexed by the low three bits of a code
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: the fixed sign vector of the RHT (``with_random_sign_mask``; all +1 without it)
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
_FLOAT32_MAX = torch.finfo(torch.float32).max


def global_amax(a: torch.Tensor) -> torch.Tensor:
    """float32 ``(1,)`` amax of ``a``: ``max |x|`` with NaN elements ignored (0 when empty), so
    one NaN poisons only its own block (whose block amax is NaN), not the global scale."""
    if a.numel() == 0:
        return torch.zeros(1, device=a.device)
    if a.device.type == "cpu":  # no |x| buffer (aminmax propagates NaN: then the pass below)
        low, high = torch.aminmax(a.detach())
        amax = torch.maximum(high.float(), low.float().neg()).abs()
        if not bool(torch.isnan(amax)):
            return amax.reshape(1)
    # One pass without a host sync elsewhere (this cast runs, and may be captured, on GPUs).
    v = a.detach().float().abs()
    return torch.where(torch.isnan(v), torch.zeros_like(v), v).amax().reshape(1)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """``S_enc`` (float32) from a float32 amax tensor (any shape): ``448 * 6 / amax``,
    clamped to the float32 maximum, 1 where ``amax`` is 0 or the quotient is 0."""
    amax = amax.float()
    s = torch.full_like(amax, E4M3_MAX * E2M1_MAX) / amax
    s = torch.clamp(s, max=_FLOAT32_MAX)
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def e2m1_encode(v: torch.Tensor, *, stochastic: bool = False, generator=None) -> torch.Tensor:
    """4-bit codes (``torch.uint8``, values 0..15) of float32 ``v`` (already scaled).

    The magnitude (NaN as 0, clamped to 6) is rounded to the E2M1 grid: to nearest with ties
    to the even code, or stochastically up to the next grid point with probability ``(|v| -
    lo) / (hi - lo)``. The grid is every multiple of ``step = 2**(max(E, 0) - 1)`` in the
    binade ``[2**E, 2**(E+1))`` of the magnitude (0.5 below 2, 1 in ``[2, 4)``, 2 in ``[4,
    6]``) and the code of a grid point is ``magnitude / step + 2 * max(E, 0)``, so with ``q =
    magnitude / step`` (exact: a power of two) the code is ``round_half_even(q) + 2 max(E,
    0)``, whose parity is that of ``q``, or ``floor(q) + 2 max(E, 0)`` plus one with
    probability ``q - floor(q)`` (0 at 6, the top). A rounding up to ``4 * step`` lands on the
    next binade's first point, whose code the formula also gives."""
    # One new buffer, then in place: NaN as +0 (no sign bit), +-Inf as +-max (clamped to 6).
    q = torch.nan_to_num(v.float(), nan=0.0).contiguous()
    sign = torch.signbit(q)
    q.abs_().clamp_(max=E2M1_MAX)
    e = (q.view(torch.int32) >> 23).sub_(127).clamp_(0, 2)  # 0 below 2 (and for 0)
    q.div_((e + 126).bitwise_left_shift_(23).view(torch.float32))  # / 2**(e - 1)
    if stochastic:
        u = torch.rand(q.shape, generator=generator, device=q.device, dtype=torch.float32)
        lo = torch.floor(q)
        code = lo.add_((u < q.sub_(lo)).float())
    else:
        code = torch.round(q)  # half to even
    code = code.to(torch.uint8).add_(e.to(torch.uint8).bitwise_left_shift_(1))
    return code.bitwise_or_(sign.to(torch.uint8).bitwise_left_shift_(3))


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit codes. The code's three magnitude bits placed at bits 11..9 of a
    float16 (sign at bit 15) give the E2M1 value times ``2**-14`` exactly: the two exponent bits
    as the float16 exponent field (bias 15 against E2M1's 1), the mantissa bit as the top
    mantissa bit, and E2M1's subnormal 0.5 lands on float16's subnormals with the same factor.
    Integer moves on two bytes an element, then one exact upcast and power-of-two multiply."""
    bits = codes.to(torch.int16)
    sign = (bits & 8) << 12
    bits.bitwise_and_(7).bitwise_left_shift_(9).bitwise_or_(sign)
    return bits.view(torch.float16).float().mul_(16384.0)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[..., C]`` two per byte: ``[..., ceil(C/2)]`` (even index in the low
    nibble)."""
    c = codes.shape[-1]
    if c % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor, length: int) -> torch.Tensor:
    """Codes ``[..., length]`` of bytes packed by :func:`pack_fp4`."""
    low, high = packed & 0xF, packed >> 4
    codes = torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return codes[..., :length]


_RHT_CACHE: dict = {}  # (with_random_sign_mask, device) -> the matrix (a constant)


def rht_matrix(with_random_sign_mask: bool = True, device=None) -> torch.Tensor:
    """``R = H16 @ diag(signs) / 4`` (float32, ``[16, 16]``): entry ``[i, j]`` is
    ``(-1)^popcount(i & j) * signs[j] / 4``. A new tensor each call (callers may write it); built
    once per device (from Python lists: thousands of tiny torch operations)."""
    key = (bool(with_random_sign_mask), torch.device(device) if device is not None else None)
    cached = _RHT_CACHE.get(key)
    if cached is None:
        cached = _RHT_CACHE[key] = _build_rht_matrix(with_random_sign_mask, device)
    return cached.clone()


def _build_rht_matrix(with_random_sign_mask: bool, device) -> torch.Tensor:
    idx = torch.arange(NVFP4_BLOCK_LEN, device=device)
    bits = idx.reshape(-1, 1) & idx.reshape(1, -1)
    parity = torch.zeros_like(bits)
    for shift in range(4):
        parity ^= (bits >> shift) & 1
    h = 1.0 - 2.0 * parity.float()
    if with_random_sign_mask:
        h = h * torch.tensor(RHT_SIGNS, dtype=torch.float32, device=device)
    return h * 0.25


def apply_rht(
    a: torch.Tensor, *, inverse: bool = False, with_random_sign_mask: bool = True
) -> torch.Tensor:
    """RHT of the rows of float32 ``a [R, C]``: each full 16-block ``v`` of a row becomes
    ``R @ v`` (``R.T @ v`` with ``inverse``); a trailing partial block is unchanged."""
    r, c = a.shape
    full = (c // NVFP4_BLOCK_LEN) * NVFP4_BLOCK_LEN
    mat = rht_matrix(with_random_sign_mask, a.device)
    if not inverse:
        mat = mat.t()  # row-vector form: v @ R.T == (R @ v).T
    # The blocks as the rows of one row-major [R * C / 16, 16] matrix: one GEMM. The column-wise
    # casts pass a transposed view, whose blocks were a strided batch (30x slower on the CPU).
    # Both forms sum a block's 16 products in the same order (same bits: pinned against the
    # batched form in test_reference_fp4_fast_paths, and CPU against CUDA in test_nvfp4_tensor).
    rows_major = a.to(torch.float32, memory_format=torch.contiguous_format)
    if full == c:
        out = (rows_major.reshape(-1, NVFP4_BLOCK_LEN) @ mat).reshape(r, c)
    else:
        out = rows_major.clone() if rows_major.data_ptr() == a.data_ptr() else rows_major
        out[:, :full] = (out[:, :full].reshape(-1, NVFP4_BLOCK_LEN) @ mat).reshape(r, full)
    if not a.is_contiguous() and a.t().is_contiguous():
        out = out.t().contiguous().t()  # the input's layout, which the callers' GEMMs read
    return out


def _block_view(v: torch.Tensor, rows: int) -> tuple[torch.Tensor, int, int]:
    r, c = v.shape
    n = NVFP4_BLOCK_LEN
    pad_r, pad_c = round_up(r, rows) - r, round_up(c, n) - c
    if pad_r or pad_c:
        v = torch.nn.functional.pad(v, (0, pad_c, 0, pad_r))
    rb, cb = v.shape[0] // rows, v.shape[1] // n
    return v.reshape(rb, rows, cb, n), rb, cb


def nvfp4_cast(
    a: torch.Tensor,
    amax: torch.Tensor,
    *,
    two_d: bool = False,
    stochastic: bool = False,
    generator=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 cast of float32 ``a [R, C]`` with global amax ``amax`` (one-element float32).

    Returns ``(codes [R, C] uint8 unpacked, scales)``: E4M3 scale bytes ``[R, ceil(C/16)]``
    for 1x16 blocks along ``C``, or ``[ceil(R/16), ceil(C/16)]`` for 16x16 blocks
    (``two_d``). Partial blocks are zero-padded for the block amax.
    """
    r, c = a.shape
    rows = NVFP4_BLOCK_LEN if two_d else 1
    v = a.detach().float()
    blocks, rb, cb = _block_view(v, rows)
    s_enc = nvfp4_global_scale(amax.reshape(()).to(v.device))
    block_amax = blocks.abs().amax(dim=(1, 3)) if blocks.numel() else blocks.new_zeros(rb, cb)
    decode = torch.clamp((block_amax / E2M1_MAX) * s_enc, max=E4M3_MAX)
    scale_e4m3 = decode.to(torch.float8_e4m3fn)
    s = scale_e4m3.float()
    encode = torch.where(s == 0, torch.zeros_like(s), s_enc / torch.where(s == 0, 1.0, s))
    encode = torch.clamp(encode, max=_FLOAT32_MAX)
    scaled = (blocks * encode.reshape(rb, 1, cb, 1)).reshape(rb * rows, cb * NVFP4_BLOCK_LEN)
    codes = e2m1_encode(scaled[:r, :c], stochastic=stochastic, generator=generator)
    return codes.contiguous(), scale_e4m3.view(torch.uint8)


def nvfp4_dequantize(
    codes: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, out_dtype=torch.float32
) -> torch.Tensor:
    """Values of unpacked codes ``[R, C]`` with 1x16 E4M3 scale bytes (at least
    ``[R, ceil(C/16)]``): ``e2m1 * s_b / S_enc`` in float32, rounded once to ``out_dtype``."""
    r, c = codes.shape
    n = NVFP4_BLOCK_LEN
    cb = -(-c // n)
    s = scales[:r, :cb].contiguous().view(torch.float8_e4m3fn).float()
    v = e2m1_decode(codes)
    if cb * n != c:
        v = torch.nn.functional.pad(v, (0, cb * n - c))
    s_enc = nvfp4_global_scale(amax.reshape(()).to(codes.device))
    value = ((v.reshape(r, cb, n) * s.unsqueeze(-1)) / s_enc).reshape(r, cb * n)[:, :c]
    return value.contiguous() if out_dtype == torch.float32 else value.to(out_dtype)
