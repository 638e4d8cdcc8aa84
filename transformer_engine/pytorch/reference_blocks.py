"""Pure-PyTorch reference of the block-scaled casts (``Float8BlockScaling``, ``MXFP8BlockScaling``):
the CPU execution path and the oracle of the native block-cast kernels, with the conventions of
:mod:`.reference` (saturating casts, canonical NaN bytes, float32 arithmetic in the kernels' order).
"""

from __future__ import annotations

import torch

from .constants import fp8_max as _fp8_max
from .constants import to_torch_fp8_dtype
from .reference import (
    FLOAT32_MAX,
    FP8_CANONICAL_NAN,
    SIGN_AND_EXPONENT_MASK,
    fp8_to_float32_unscaled,
    transpose_last_dim_first,
)
from .utils import round_up_to_nearest_multiple as round_up

__all__ = [
    "BLOCK_SCALING_BLOCK_LEN",
    "block_scale_from_amax",
    "block_cast_1d",
    "block_cast_1d_of_transpose",
    "block_cast_2d",
    "block_dequantize_1d",
    "block_dequantize_2d",
    "reciprocal_elementwise",
    "MXFP8_BLOCK_LEN",
    "mxfp8_scale_exponent",
    "mxfp8_cast",
    "mxfp8_dequantize",
]


# ------------------------------------------------------------------ block scaling (Float8BlockScaling)
#
# A tensor is cast as a matrix ``[R, C]`` cut into blocks: 1-D blocks are 1x128 tiles along C
# (one scale per row and 128 columns), 2-D blocks 128x128 squares. Partial blocks at the edges
# are zero-padded, which changes no amax. Each block's float32 scale comes from its own amax
# (:func:`block_scale_from_amax`); the cast multiplies in float32, saturates and rounds to
# nearest even, exactly as the per-tensor cast does. The scale-inverses are stored in the
# "GEMM_READY" layout the block-scaled GEMMs read (zeros in the padding):
#
# * 1-D: ``[ceil(C/128), roundup(R, 4)]``, entry ``[j, i]`` for tile (row i, tile j): already
#   transposed, so each tile column's scales are contiguous;
# * 2-D: ``[ceil(R/128), roundup(ceil(C/128), 4)]``, entry ``[i, j]`` for block (i, j).
#
# A finite block's scaled values need no clamp: ``scale = RN(fp8_max / a)`` with ``a >= amax``
# (epsilon only raises ``a``; power-of-2 scales only round down; ``value_for_inf`` replaces a
# quotient only when ``a`` is tiny), so ``|x * scale| <= fp8_max * (1 + 2**-24)**2``, which
# torch's conversion rounds to ``fp8_max`` exactly as the saturating cast does.

BLOCK_SCALING_BLOCK_LEN = 128


def block_scale_from_amax(
    block_amax: torch.Tensor,
    fp8_dtype,
    *,
    epsilon: float = 0.0,
    force_pow_2_scales: bool = True,
    value_for_inf: float = FLOAT32_MAX,
) -> torch.Tensor:
    """Float32 scales of blocks from their amaxes (any shape; NaN-free amaxes).

    ``a = max(amax, epsilon)``; ``scale = fp8_max / a``; an infinite quotient (``a`` zero or
    tiny) becomes ``value_for_inf`` (the largest value of the input's dtype); with
    ``force_pow_2_scales`` the mantissa is cleared (rounded down to a power of 2); finally
    ``a == 0`` (an all-zero block, no epsilon) gives scale 1. An infinite amax gives scale 0.
    """
    a = block_amax.float()
    a = torch.clamp_min(a, float(epsilon)) if epsilon > 0 else a
    # A tensor divided by a tensor: IEEE float32 division (``scalar / tensor`` would be
    # computed as ``reciprocal(tensor) * scalar``, one rounding more).
    scale = torch.full_like(a, _fp8_max(fp8_dtype)) / a
    # In place on the fresh quotient, few operations: every block cast calls this twice. The
    # quotient holds no NaN (a >= 0, NaN-free) and no -Inf, so only +Inf is replaced.
    scale = torch.nan_to_num_(scale, posinf=value_for_inf)
    if force_pow_2_scales:
        scale.view(torch.int32).bitwise_and_(SIGN_AND_EXPONENT_MASK)
    return scale.masked_fill_(a == 0, 1.0)


def _saturating_cast_(
    v: torch.Tensor, fp8_dtype, may_hold_nan: bool, in_range: bool = False
) -> torch.Tensor:
    """``v`` (float32, already scaled; clamped in place) clamped to the format's range and
    rounded; NaN bytes canonical. ``may_hold_nan=False`` (the caller knows every value is
    finite or +-Inf) skips the NaN search; with it, ``in_range`` (the caller knows every
    ``|v|`` is at most the format's largest value times ``1 + 2**-23``) skips the clamp, which
    changes no byte then: torch rounds such a value to the largest value, as the clamp does."""
    dtype = to_torch_fp8_dtype(fp8_dtype)
    limit = _fp8_max(dtype)
    if in_range and not may_hold_nan:
        return v.to(dtype)
    out = v.clamp_(-limit, limit).to(dtype)  # clamp keeps NaN
    if may_hold_nan:
        nan = torch.isnan(v)
        if bool(nan.any()):
            bits = out.view(torch.uint8)
            bits.copy_(torch.where(nan, torch.full_like(bits, FP8_CANONICAL_NAN), bits))
    return out


def _padded_blocks(a: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, bool]:
    """``a [R, C]`` as a contiguous float32 matrix zero-padded to ``[roundup(R, rows),
    roundup(C, cols)]``, and whether that is a new buffer (the cast may then scale it in place;
    ``a`` itself, float32 and contiguous, is never written). One pass over ``a`` whatever its
    dtype and strides: the transposed view of the column-wise cast becomes contiguous here, so
    no later pass walks it with a long stride."""
    r, c = a.shape
    x = a.detach()
    pad_r, pad_c = round_up(r, rows) - r, round_up(c, cols) - c
    if pad_r or pad_c:
        v = torch.zeros(r + pad_r, c + pad_c, dtype=torch.float32, device=a.device)
        v[:r, :c] = x
        return v, True
    v = x.to(torch.float32, memory_format=torch.contiguous_format)
    return v, v is not x


def _block_amax(blocks: torch.Tensor, dims) -> tuple[torch.Tensor, bool]:
    """``max |x|`` over ``dims``, NaN ignored (like ``fmaxf``), +-Inf counted; and whether a
    block holds NaN or +-Inf (then the scaled values may hold NaN).

    ``max(max x, -min x)`` needs no ``|x|`` buffer; both reductions propagate NaN, so only a
    tensor with NaN in it takes the NaN-ignoring pass."""
    if blocks.numel() == 0:
        return blocks.sum(dim=dims), False  # zeros of the reduced shape
    # Two reductions: torch's aminmax over one dimension is several times slower on the CPU.
    low, high = blocks.amin(dim=dims), blocks.amax(dim=dims)
    amax = torch.maximum(high, low.neg_()).abs_()  # abs_: +0 for an all-zero block
    finite = bool(torch.isfinite(amax).all())
    if not finite and bool(torch.isnan(amax).any()):
        mag = blocks.abs()
        amax = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag).amax(dim=dims)
    return amax, not finite


def _matrix_blocks(a: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, bool]:
    """``a [R, C]`` as float32 blocks ``[Rb, rows, Cb, cols]`` (zero-padded; a 1-D tile is a
    block of one row) and whether they are a new buffer (see :func:`_padded_blocks`)."""
    v, owned = _padded_blocks(a, rows, cols)
    return v.reshape(v.shape[0] // rows, rows, v.shape[1] // cols, cols), owned


def _cast_blocks(
    blocks: torch.Tensor,
    owned: bool,
    factor: torch.Tensor,
    fp8_dtype,
    may_hold_nan: bool,
    shape,
    in_range: bool = False,
) -> torch.Tensor:
    """``blocks [Rb, rows, Cb, cols]`` times their ``factor [Rb, Cb]``, saturated and rounded to
    FP8, as the contiguous matrix of ``shape`` (the padding cut off). The product is computed in
    place when ``blocks`` is the cast's own buffer (a fresh multi-MiB product costs the CPU page
    faults), else new. ``in_range``: see :func:`_saturating_cast_`."""
    rb, rows, cb, cols = blocks.shape
    factor = factor.reshape(rb, 1, cb, 1)
    scaled = blocks.mul_(factor) if owned else blocks * factor
    data = _saturating_cast_(scaled, fp8_dtype, may_hold_nan, in_range)
    data = data.reshape(rb * rows, cb * cols)
    return data[: shape[0], : shape[1]].contiguous()


def _float8_block_cast(
    a: torch.Tensor, fp8_dtype, rows: int, options, cols: int = BLOCK_SCALING_BLOCK_LEN
) -> tuple:
    """The cast of ``a [R, C]`` in blocks of ``rows x cols``: ``(data [R, C], scale [Rb, Cb])``
    (the float32 scales, before the layouts :func:`block_cast_1d` / :func:`block_cast_2d`
    store their inverses in)."""
    blocks, owned = _matrix_blocks(a, rows, cols)
    amax, not_finite = _block_amax(blocks, (1, 3))
    scale = block_scale_from_amax(amax, fp8_dtype, **options)
    data = _cast_blocks(blocks, owned, scale, fp8_dtype, not_finite, a.shape, in_range=True)
    return data, scale


def _scale_inv_layout(scale: torch.Tensor) -> torch.Tensor:
    """The GEMM_READY scale-inverses of ``scale [n, m]`` (already in the stored orientation):
    ``[n, roundup(m, 4)]``, zeros in the padding."""
    n, m = scale.shape
    scale_inv = torch.zeros(n, round_up(m, 4), dtype=torch.float32, device=scale.device)
    scale_inv[:, :m] = reciprocal_elementwise(scale)
    return scale_inv


def block_cast_1d(
    a: torch.Tensor,
    fp8_dtype,
    *,
    epsilon: float = 0.0,
    force_pow_2_scales: bool = True,
    value_for_inf: float = FLOAT32_MAX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128-tile cast of the matrix ``a [R, C]``: ``(data [R, C] FP8, scale_inv)`` with
    ``scale_inv`` of shape ``[ceil(C/128), roundup(R, 4)]`` (see the section comment)."""
    options = {"epsilon": epsilon, "force_pow_2_scales": force_pow_2_scales,
               "value_for_inf": value_for_inf}  # fmt: skip
    data, scale = _float8_block_cast(a, fp8_dtype, 1, options)  # scale [R, Cb]
    return data, _scale_inv_layout(scale.t())


def block_cast_1d_of_transpose(
    a: torch.Tensor,
    fp8_dtype,
    *,
    epsilon: float = 0.0,
    force_pow_2_scales: bool = True,
    value_for_inf: float = FLOAT32_MAX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_cast_1d` of ``a.t()`` (the column-wise copy of ``a [R, C]``), bit for bit,
    computed in ``a``'s own layout: a tile of ``a.t()`` is 128 consecutive rows of one column
    of ``a``, so the amaxes, scales and casts run over ``a`` as it lies and only the FP8 bytes
    are transposed at the end. On the CPU that replaces a float32 conversion of the transposed
    view (a strided pass, about 1 ms per million elements) with contiguous passes and a byte
    transpose. Returns ``(data [C, R] FP8, scale_inv [ceil(R/128), roundup(C, 4)])``."""
    options = {"epsilon": epsilon, "force_pow_2_scales": force_pow_2_scales,
               "value_for_inf": value_for_inf}  # fmt: skip
    # 128x1 blocks: scale [Rb, C]
    data, scale = _float8_block_cast(a, fp8_dtype, BLOCK_SCALING_BLOCK_LEN, options, cols=1)
    return transpose_last_dim_first(data), _scale_inv_layout(scale)


def block_cast_2d(
    a: torch.Tensor,
    fp8_dtype,
    *,
    epsilon: float = 0.0,
    force_pow_2_scales: bool = True,
    value_for_inf: float = FLOAT32_MAX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128-block cast of the matrix ``a [R, C]``: ``(data [R, C] FP8, scale_inv)`` with
    ``scale_inv`` of shape ``[ceil(R/128), roundup(ceil(C/128), 4)]``."""
    options = {"epsilon": epsilon, "force_pow_2_scales": force_pow_2_scales,
               "value_for_inf": value_for_inf}  # fmt: skip
    data, scale = _float8_block_cast(a, fp8_dtype, BLOCK_SCALING_BLOCK_LEN, options)
    return data, _scale_inv_layout(scale)


def reciprocal_elementwise(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` per element in float32 (IEEE division: scale 0 gives +Inf)."""
    return torch.ones_like(scale) / scale


def _upcast_with_scales(data: torch.Tensor, scale_inv: torch.Tensor) -> tuple:
    """``(values, scales)`` (float32) whose products are ``fp8 * scale_inv`` bit for bit: the
    FP8 upcast's power-of-two factor (:func:`.reference.fp8_to_float32_unscaled`) goes into the
    few scales instead of a pass over every value. Exact: ``(v * f) * s`` and ``v * (f * s)``
    are the same real number rounded once, as long as ``f * s`` does not overflow (a scale
    that large, or an infinite one, has the factor applied to the values instead)."""
    v, factor = fp8_to_float32_unscaled(data)
    s = scale_inv.float()
    if factor == 1.0:
        return v, s
    if bool((s.abs() > FLOAT32_MAX / factor).any()):
        return v.mul_(factor), s
    return v, s * factor


def block_dequantize_1d(
    data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`block_cast_1d`: ``fp8 * scale_inv`` per tile in float32, rounded once
    to ``out_dtype``; ``data`` is ``[R, C]``."""
    r, c = data.shape
    n = BLOCK_SCALING_BLOCK_LEN
    cb = -(-c // n)
    v, s = _upcast_with_scales(data, scale_inv[:cb, :r].t())  # s: [R, Cb]
    if cb * n != c:
        v = torch.nn.functional.pad(v, (0, cb * n - c))
    value = v.reshape(r, cb, n).mul_(s.unsqueeze(-1)).reshape(r, cb * n)[:, :c]  # v is new
    return value.contiguous() if out_dtype == torch.float32 else value.to(out_dtype)


def block_dequantize_2d(
    data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`block_cast_2d` (``data`` is ``[R, C]``)."""
    r, c = data.shape
    n = BLOCK_SCALING_BLOCK_LEN
    rb, cb = -(-r // n), -(-c // n)
    v, s = _upcast_with_scales(data, scale_inv[:rb, :cb])
    v = torch.nn.functional.pad(v, (0, cb * n - c, 0, rb * n - r))
    value = v.reshape(rb, n, cb, n).mul_(s.reshape(rb, 1, cb, 1)).reshape(rb * n, cb * n)
    value = value[:r, :c]
    return value.contiguous() if out_dtype == torch.float32 else value.to(out_dtype)


# ------------------------------------------------------------------ MXFP8 (32-element blocks)
#
# One E8M0 byte ``e`` per 32 consecutive elements of a row of ``a [R, C]`` (the row-wise copy;
# the column-wise copy is this cast of the transpose). The rule is upstream's
# ``float_to_e8m0(amax * (1 / fp8_max))``: the float32 quotient's exponent field, plus one when
# its mantissa is non-zero (round up, so ``amax / 2^(e-127) <= fp8_max``), except that exponent
# 254 is not bumped (saturate) and a denormal quotient ``<= 2^-127`` keeps exponent 0; amax 0 ->
# 0, an infinite quotient -> 254, NaN -> 255. Values are multiplied by ``2^(127-e)`` (1 when
# ``e == 0``; upstream's ``exp2f_rcp``) in float32 and rounded to FP8; the scale-inverse read
# back is ``2^(e-127)``.

MXFP8_BLOCK_LEN = 32


def mxfp8_scale_exponent(block_amax: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """E8M0 bytes (``torch.uint8``) of blocks from their float32 amaxes (NaN-free)."""
    one = torch.ones((), dtype=torch.float32, device=block_amax.device)
    rcp = one / torch.full_like(one, _fp8_max(fp8_dtype))  # float32 1 / fp8_max, as upstream
    q = block_amax.float() * rcp
    bits = q.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    bump = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + bump.to(torch.int32)
    e = torch.where(torch.isposinf(q), torch.full_like(e, 0xFE), e)
    e = torch.where(torch.isnan(q), torch.full_like(e, 0xFF), e)
    return torch.where(q == 0, torch.zeros_like(e), e).to(torch.uint8)


def _e8m0_multiplier(e: torch.Tensor) -> torch.Tensor:
    """``2^(127-e)`` in float32 by its bits (``e == 0`` -> 1), as upstream's ``exp2f_rcp``."""
    e = e.to(torch.int32)
    m = ((254 - e) << 23).view(torch.float32)
    return torch.where(e == 0, torch.ones_like(m), m)


def _e8m0_value(e: torch.Tensor) -> torch.Tensor:
    """``2^(e-127)`` in float32 (``e == 0`` -> the denormal ``2^-127``, 255 -> NaN)."""
    e = e.to(torch.int32)
    v = (e << 23).view(torch.float32)
    v = torch.where(e == 0, torch.full_like(v, 2.0**-127), v)
    return torch.where(e == 0xFF, torch.full_like(v, float("nan")), v)


def mxfp8_cast(
    a: torch.Tensor, fp8_dtype, *, two_d: bool = False, columnwise: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 cast of the matrix ``a [R, C]``: ``(data [R, C] FP8, exponents)``.

    1x32 blocks along ``C`` (``exponents [R, ceil(C/32)]``), with ``columnwise`` 32x1 blocks
    along ``R`` (the column-wise copy, bit for bit the transpose of the cast of ``a.t()``, but
    computed in ``a``'s own layout: ``exponents [ceil(R/32), C]``), or with ``two_d`` 32x32
    blocks (``exponents [ceil(R/32), ceil(C/32)]``). Partial blocks are zero-padded for the
    amax.
    """
    if two_d and columnwise:
        raise ValueError("mxfp8_cast: two_d and columnwise exclude each other")
    rows = MXFP8_BLOCK_LEN if two_d or columnwise else 1
    blocks, owned = _matrix_blocks(a, rows, 1 if columnwise else MXFP8_BLOCK_LEN)
    amax, not_finite = _block_amax(blocks, (1, 3))
    e = mxfp8_scale_exponent(amax, fp8_dtype)
    return _cast_blocks(blocks, owned, _e8m0_multiplier(e), fp8_dtype, not_finite, a.shape), e


def mxfp8_dequantize(
    data: torch.Tensor, exponents: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`mxfp8_cast` with 1x32 blocks: ``fp8 * 2^(e-127)`` in float32, rounded
    once to ``out_dtype``; ``data`` is ``[R, C]``, ``exponents`` at least ``[R, ceil(C/32)]``."""
    r, c = data.shape
    n = MXFP8_BLOCK_LEN
    cb = -(-c // n)
    v, s = _upcast_with_scales(data, _e8m0_value(exponents[:r, :cb]))
    if cb * n != c:
        v = torch.nn.functional.pad(v, (0, cb * n - c))
    value = v.reshape(r, cb, n).mul_(s.unsqueeze(-1)).reshape(r, cb * n)[:, :c]  # v is new
    return value.contiguous() if out_dtype == torch.float32 else value.to(out_dtype)
