"""Pure-PyTorch reference for every native kernel.

This module is two things at once: the CPU execution path (any tensor that is
not on a CUDA device is computed here), and the oracle the GPU tests compare
the native kernels against, bit for bit. Each function states the exact
arithmetic, in float32, in the order the CUDA kernels perform it; change one
side only together with the other.

Conventions shared with the kernels:

* Casts saturate: ``x * scale`` is clamped to the largest finite FP8 value
  before rounding (round to nearest even), so +-Inf becomes +-max. NaN stays
  NaN and is written as the canonical pattern ``0x7F`` (sign cleared) in both
  formats, so NaN payloads compare equal bitwise.
* amax is ``max |x|`` of the *unscaled* input in float32. NaN elements are
  ignored (like ``fmaxf``); +-Inf counts. An empty input contributes nothing.
* ``scale_inv`` is ``1 / scale`` (IEEE float32 division).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .constants import fp8_max as _fp8_max
from .constants import to_torch_fp8_dtype
from .utils import round_up_to_nearest_multiple as round_up

__all__ = [
    "FP8_CANONICAL_NAN",
    "FLOAT32_MAX",
    "amax",
    "cast_to_fp8",
    "cast_to_fp8_with_amax",
    "fp8_to_float32",
    "fp8_to_float32_unscaled",
    "transpose_last_dim_first",
    "column_sum",
    "reciprocal",
    "dequantize",
    "scaled_fp8_max",
    "compute_scale_from_amax",
    "delayed_scaling_update",
    "BLOCK_SCALING_BLOCK_LEN",
    "block_scale_from_amax",
    "block_cast_1d",
    "block_cast_2d",
    "block_dequantize_1d",
    "block_dequantize_2d",
    "MXFP8_BLOCK_LEN",
    "mxfp8_scale_exponent",
    "mxfp8_cast",
    "mxfp8_dequantize",
]

FP8_CANONICAL_NAN = 0x7F
FLOAT32_MAX = torch.finfo(torch.float32).max
_SIGN_AND_EXPONENT_MASK = -8388608  # 0xFF800000 as a signed int32
_E4M3_TO_FP16_MASK = -16385  # 0xBFFF as a signed int16
# Inputs whose float32 upcast is exact (and cheap): the cast multiplies in float32 after it.
_NARROW_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` in float32 as a one-element tensor; NaN ignored, 0 for an empty tensor."""
    xd = x.detach()
    if xd.dtype not in _NARROW_FLOAT_DTYPES:
        xd = xd.float()
    return _amax_and_nan(xd)[0]


def _amax_and_nan(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """:func:`amax` of ``x`` and whether ``x`` holds a NaN.

    One reduction pass in ``x``'s own dtype (``max(-min, max)`` is exact in every float dtype,
    and rounding to float32 is monotone, so it equals the float32 ``max |x|``); the NaN-ignoring
    ``where`` pass runs only when that reduction saw a NaN. The final ``abs`` turns a ``-0.0``
    from an all-zero input into ``+0.0``, as ``abs`` before the reduction does.
    """
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device), False
    lo, hi = torch.aminmax(x)
    m = torch.maximum(-lo, hi)  # NaN propagates through aminmax and maximum
    if not bool(torch.isnan(m)):
        return m.float().abs().reshape(1), False
    a = x.float().abs()
    a = torch.where(torch.isnan(a), torch.zeros((), dtype=a.dtype, device=a.device), a)
    return a.amax().reshape(1), True


def cast_to_fp8(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Saturating cast of ``x * scale`` (float32 product) to FP8, same shape as ``x``.

    Written into ``out`` (an FP8 tensor of ``x``'s shape) when given, else into a new tensor.
    """
    return cast_to_fp8_with_amax(x, scale, fp8_dtype, out=out)[0]


def cast_to_fp8_with_amax(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype,
    *,
    out: torch.Tensor | None = None,
    consume_input: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cast_to_fp8` and :func:`amax` of ``x`` together (the amax is needed anyway).

    ``consume_input``: ``x`` is a float32 buffer the caller gives up, so the scaled values are
    computed in it instead of a new tensor (a fresh multi-MiB buffer costs the CPU more in page
    faults than the multiply itself); it holds garbage afterwards. A ``x`` of another dtype is
    converted into a new buffer either way.

    The amax decides how much work the cast needs: ``x * scale`` holds no NaN when ``x`` has
    none and both ``max |x|`` and ``scale`` are finite, and needs no clamp when
    ``max |x| * |scale| <= fp8_max`` (the exact double product of two float32 values; float32
    rounding is monotone, so no element's float32 product exceeds it). Only the general case
    clamps and rewrites NaN bytes; every case gives the same bytes.
    """
    dtype = to_torch_fp8_dtype(fp8_dtype)
    limit = _fp8_max(dtype)
    xd = x.detach()
    if xd.dtype not in _NARROW_FLOAT_DTYPES:
        xd = xd.float()
    x_amax, has_nan = _amax_and_nan(xd)
    s = scale.detach().float().reshape(())
    v = xd.float()
    # Never in place on the caller's float32 tensor, unless it is given up.
    v = v * s if v is xd and not consume_input else v.mul_(s)
    if out is None:
        out = torch.empty(v.shape, dtype=dtype, device=v.device)
    a, s_value = float(x_amax), abs(float(s))
    if not has_nan and math.isfinite(a) and math.isfinite(s_value):
        if a * s_value > limit:
            v.clamp_(-limit, limit)
        out.copy_(v)  # no NaN in v
        return out, x_amax
    nan = torch.isnan(v)
    out.copy_(v.clamp_(-limit, limit))
    bits = out.view(torch.uint8)
    canonical = torch.tensor(FP8_CANONICAL_NAN, dtype=torch.uint8, device=v.device)
    bits.copy_(torch.where(nan, canonical, bits))
    return out, x_amax


def transpose_last_dim_first(
    data: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The column-wise copy: ``data`` viewed as ``[rows, last]``, transposed, shaped ``(last, *leading)``.

    Written into ``out`` (contiguous, ``data``'s dtype and that shape) when given.
    """
    if data.dim() == 0:
        raise ValueError("a 0-d tensor has no last dimension to transpose")
    cols = data.shape[-1]
    rows = math.prod(data.shape[:-1])  # not reshape(-1, cols): no -1 is inferred when cols is 0
    flat = data.reshape(rows, cols)
    if data.element_size() != 1:
        if out is None:
            return flat.t().contiguous().reshape(cols, *data.shape[:-1])
        out.view(cols, rows).copy_(flat.t())
        return out
    if out is None:
        out = torch.empty((cols, *data.shape[:-1]), dtype=data.dtype, device=data.device)
    # FP8 through uint8: copies of FP8 tensors are not supported on every torch version.
    _copy_transposed_bytes(flat.view(torch.uint8), out.view(torch.uint8).view(cols, rows))
    return out


_WORD_TRANSPOSE_MIN_BYTES = 1 << 14  # smaller byte transposes take the plain copy


def _copy_transposed_bytes(flat: torch.Tensor, target: torch.Tensor) -> None:
    """``target [cols, rows]`` (contiguous uint8) = ``flat [rows, cols]`` (uint8) transposed.

    torch copies a transposed 2-D byte matrix with a single-threaded tiled loop (about 0.55 ms
    per million bytes on this 2-core CPU). Where a row is a whole number of 8- (or 4-) byte
    words, two multithreaded copies move the same bytes in about 0.23 ms: the words are
    transposed as words (``[rows, cols/w] -> [cols/w, rows]``, each still holding ``w``
    consecutive bytes of one input row), then each word is split across ``w`` output rows
    (byte ``j`` of word ``[c, r]`` is ``flat[r, c*w + j]``, so it goes to
    ``target[c*w + j, r]``). Only whole bytes are copied, so every byte lands unchanged.
    """
    rows, cols = flat.shape
    word = torch.int64 if cols % 8 == 0 else torch.int32 if cols % 4 == 0 else None
    if not (
        word is not None
        and flat.device.type == "cpu"
        and flat.numel() >= _WORD_TRANSPOSE_MIN_BYTES
        and flat.is_contiguous()
        and flat.storage_offset() % word.itemsize == 0  # view() as words needs aligned rows
    ):
        target.copy_(flat.t())
        return
    w, n = word.itemsize, cols // word.itemsize
    words = torch.empty(n, 1, rows, dtype=word, device=flat.device)
    # 3-D on purpose: a 2-D transposed source would take torch's single-threaded tiled copy.
    words.copy_(flat.view(word).t().unsqueeze(1))
    target.view(n, w, rows).copy_(words.view(torch.uint8).view(n, rows, w).transpose(1, 2))


def column_sum(x: torch.Tensor) -> torch.Tensor:
    """The bias gradient of a linear layer from its output gradient ``x``: the sum over every
    dimension but the last, accumulated in float32 and rounded once to ``x``'s dtype.

    (The native kernel adds 64-row tiles first, then the tiles: the same math in another order,
    so it matches within float32 rounding, not bit for bit.)
    """
    if x.dim() == 0:
        raise ValueError("a 0-d tensor has no last dimension to sum into")
    return x.reshape(-1, x.shape[-1]).float().sum(dim=0).to(x.dtype)


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` in float32 as a one-element tensor."""
    s = scale.detach().float().reshape(1)
    return torch.ones_like(s) / s


def fp8_to_float32(data: torch.Tensor) -> torch.Tensor:
    """The exact float32 value of every FP8 element, bitwise equal to ``data.float()``.

    :func:`fp8_to_float32_unscaled` times its power-of-two factor (an exact multiply).
    """
    value, factor = fp8_to_float32_unscaled(data)
    return value if factor == 1.0 else value.mul_(factor)


def fp8_to_float32_unscaled(data: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(value, factor)``: float32 ``value`` with ``value * factor`` bitwise equal to
    ``data.float()``; ``factor`` is 256.0 (E4M3 without NaN) or 1.0.

    torch's own E4M3 upcast converts element by element (about 4.4 ms per million elements on
    one core, against about 0.2 ms for the bit moves below). Both formats go through float16,
    which holds every FP8 value exactly and whose upcast to float32 is vectorized:

    * E5M2 is the upper byte of a float16: ``byte << 8`` (``factor`` 1).
    * E4M3 ``s eeee mmm`` moves to float16 bits ``s 0 eeee mmm 0000000``; that float16 is the
      value times ``2**-8`` (exponent bias 15 against 7; E4M3 subnormals land on float16
      subnormals with the same factor), so ``factor`` is 256. A caller that multiplies anyway
      (the emulated GEMM's scale) folds it into its own factor and saves the pass.

    NaN bytes are the exception: the float16 route gives other NaN bits than torch (E5M2), or
    +-480 after the factor (E4M3's ``0x7F``/``0xFF``). The largest byte as int8 and as uint8
    finds them (E4M3's NaNs are 127 and 255, E5M2's 125..127 and 253..255; no other byte
    reaches those); only then does torch's own upcast run instead, with ``factor`` 1.
    """
    if data.dtype == torch.float8_e5m2:
        nan_bytes, shift, factor = (125, 253), 8, 1.0
    elif data.dtype == torch.float8_e4m3fn:
        nan_bytes, shift, factor = (127, 255), 7, 256.0
    else:
        raise TypeError(f"fp8_to_float32: data has dtype {data.dtype}; pass an FP8 tensor")
    if data.numel() and (
        int(data.view(torch.int8).max()) >= nan_bytes[0]
        or int(data.view(torch.uint8).max()) >= nan_bytes[1]
    ):
        return data.float(), 1.0
    # int8 -> int16 sign-extends (bits 8..15 = the sign). Shifted by 8 (E5M2) the byte is the
    # float16's upper byte; by 7 (E4M3) bit 15 is the sign and bit 14 a sign copy, masked off.
    bits = data.view(torch.int8).to(torch.int16).bitwise_left_shift_(shift)
    if shift == 7:
        bits.bitwise_and_(_E4M3_TO_FP16_MASK)
    return bits.view(torch.float16).float(), factor


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``fp8 * scale_inv`` computed in float32, rounded once to ``out_dtype``."""
    s = scale_inv.detach().float().reshape(())
    value = fp8_to_float32(data).mul_(s)
    return value if out_dtype == torch.float32 else value.to(out_dtype)


def scaled_fp8_max(fp8_dtype, margin: float) -> float:
    """``fp8_max * 2**-margin`` rounded to float32; the kernels receive this very value."""
    value = _fp8_max(fp8_dtype) * math.pow(2.0, -float(margin))
    return float(torch.tensor(value, dtype=torch.float32))


def compute_scale_from_amax(
    amax_value: torch.Tensor,
    fp8_dtype,
    epsilon: float = 0.0,
    force_pow_2_scales: bool = False,
) -> torch.Tensor:
    """Current-scaling scale from an amax, as a one-element float32 tensor.

    ``a = max(amax, epsilon)`` (NaN passes through); a zero, infinite or NaN ``a``
    gives scale 1; otherwise ``fp8_max / a``, with +Inf replaced by FLT_MAX;
    ``force_pow_2_scales`` then clears the mantissa (rounds down to a power of 2).
    """
    a = amax_value.detach().float().reshape(1).clone()
    eps = torch.tensor(float(epsilon), dtype=torch.float32, device=a.device)
    a = torch.where(a < eps, eps, a)
    limit = torch.tensor(_fp8_max(fp8_dtype), dtype=torch.float32, device=a.device)
    bad = (a == 0) | torch.isinf(a) | torch.isnan(a)
    scale = torch.where(bad, torch.ones_like(a), limit / torch.where(bad, torch.ones_like(a), a))
    scale = torch.where(torch.isposinf(scale), torch.full_like(scale, FLOAT32_MAX), scale)
    if force_pow_2_scales:
        scale = (scale.view(torch.int32) & _SIGN_AND_EXPONENT_MASK).view(torch.float32)
    return scale


def _max_propagating_nan(values: torch.Tensor, dim: int) -> torch.Tensor:
    # torch.amax propagates NaN, like the kernel's explicit NaN rule.
    return values.amax(dim=dim)


def delayed_scaling_update(
    amax_histories: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    fp8_dtype,
    margin: float = 0.0,
    amax_compute_algo: str = "max",
    amax_reduction_buffer: torch.Tensor | None = None,
) -> None:
    """In-place delayed-scaling update of several ``(amax_history [L, N], scale [N])`` pairs.

    Per slot ``i``: ``a`` is the reduced amax (the slot's entry in
    ``amax_reduction_buffer``, which concatenates the row 0 of every history in
    order) when non-zero, else ``H[0, i]``. If ``a == 0`` the slot is untouched
    (no roll, scale kept). Otherwise the candidate amax is ``max(H[1:, i], a)``
    for ``"max"`` (NaN propagates) or ``a`` for ``"most_recent"``; the history
    rolls so that ``a`` lands in the last row and row 0 becomes 0; and the scale
    becomes ``scaled_max / candidate`` when the candidate is finite and positive
    (+Inf results become FLT_MAX), else stays.
    """
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(
            f"amax_compute_algo={amax_compute_algo!r} is not supported; use 'max' or 'most_recent'"
        )
    if len(amax_histories) != len(scales):
        raise ValueError(
            f"got {len(amax_histories)} amax histories but {len(scales)} scales; pass one scale "
            "vector per history"
        )
    scaled_max = scaled_fp8_max(fp8_dtype, margin)
    offset = 0
    for history, scale in zip(amax_histories, scales):
        n = history.shape[-1]
        if n == 0:
            continue  # a history without slots: nothing to update
        h = history.view(-1, n)
        row0 = h[0].clone()
        if amax_reduction_buffer is not None:
            reduced = amax_reduction_buffer.reshape(-1)[offset : offset + n].float()
            a = torch.where(reduced != 0, reduced, row0)
        else:
            a = row0
        offset += n
        active = a != 0
        if amax_compute_algo == "max" and h.shape[0] > 1:
            candidate = _max_propagating_nan(torch.cat([h[1:], a.reshape(1, n)], dim=0), dim=0)
        else:
            candidate = a
        rolled = torch.cat([h[1:], a.reshape(1, n)], dim=0)
        rolled[0] = 0
        h.copy_(torch.where(active.reshape(1, n), rolled, h))
        good = active & torch.isfinite(candidate) & (candidate > 0)
        safe = torch.where(good, candidate, torch.ones_like(candidate))
        new_scale = torch.tensor(scaled_max, dtype=torch.float32, device=safe.device) / safe
        new_scale = torch.where(
            torch.isposinf(new_scale), torch.full_like(new_scale, FLOAT32_MAX), new_scale
        )
        scale.copy_(torch.where(good, new_scale, scale.float()).to(scale.dtype))


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
    scale = torch.where(torch.isposinf(scale), torch.full_like(scale, value_for_inf), scale)
    if force_pow_2_scales:
        scale = (scale.view(torch.int32) & _SIGN_AND_EXPONENT_MASK).view(torch.float32)
    return torch.where(a == 0, torch.ones_like(scale), scale)


def _saturating_cast(v: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """``v`` (float32, already scaled) clamped to the format's range and rounded; NaN bytes
    canonical."""
    dtype = to_torch_fp8_dtype(fp8_dtype)
    limit = _fp8_max(dtype)
    nan = torch.isnan(v)
    out = v.clamp(-limit, limit).to(dtype)
    if bool(nan.any()):
        bits = out.view(torch.uint8)
        bits.copy_(torch.where(nan, torch.full_like(bits, FP8_CANONICAL_NAN), bits))
    return out


def _padded_blocks(a: torch.Tensor, rows: int) -> torch.Tensor:
    """``a [R, C]`` as float32, zero-padded to ``[roundup(R, rows), roundup(C, 128)]``."""
    r, c = a.shape
    n = BLOCK_SCALING_BLOCK_LEN
    v = a.detach().float()
    pad_r, pad_c = round_up(r, rows) - r, round_up(c, n) - c
    return torch.nn.functional.pad(v, (0, pad_c, 0, pad_r)) if pad_r or pad_c else v


def _block_amax(blocks: torch.Tensor, dims) -> torch.Tensor:
    """``max |x|`` over ``dims``, NaN ignored (like ``fmaxf``), +-Inf counted."""
    mag = blocks.abs()
    mag = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag)
    return mag.amax(dim=dims) if mag.numel() else mag.sum(dim=dims)


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
    r, c = a.shape
    n = BLOCK_SCALING_BLOCK_LEN
    v = _padded_blocks(a, 1)
    cb = v.shape[1] // n
    v = v.reshape(r, cb, n)
    scale = block_scale_from_amax(
        _block_amax(v, 2), fp8_dtype, epsilon=epsilon,
        force_pow_2_scales=force_pow_2_scales, value_for_inf=value_for_inf,
    )  # fmt: skip
    data = _saturating_cast(v * scale.unsqueeze(-1), fp8_dtype).reshape(r, cb * n)[:, :c]
    scale_inv = torch.zeros(cb, round_up(r, 4), dtype=torch.float32, device=a.device)
    scale_inv[:, :r] = reciprocal_elementwise(scale).t()
    return data.contiguous(), scale_inv


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
    r, c = a.shape
    n = BLOCK_SCALING_BLOCK_LEN
    v = _padded_blocks(a, n)
    rb, cb = v.shape[0] // n, v.shape[1] // n
    blocks = v.reshape(rb, n, cb, n)
    scale = block_scale_from_amax(
        _block_amax(blocks, (1, 3)), fp8_dtype, epsilon=epsilon,
        force_pow_2_scales=force_pow_2_scales, value_for_inf=value_for_inf,
    )  # fmt: skip
    scaled = blocks * scale.reshape(rb, 1, cb, 1)
    data = _saturating_cast(scaled, fp8_dtype).reshape(rb * n, cb * n)[:r, :c]
    scale_inv = torch.zeros(rb, round_up(cb, 4), dtype=torch.float32, device=a.device)
    scale_inv[:, :cb] = reciprocal_elementwise(scale)
    return data.contiguous(), scale_inv


def reciprocal_elementwise(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` per element in float32 (IEEE division: scale 0 gives +Inf)."""
    return torch.ones_like(scale) / scale


def block_dequantize_1d(
    data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`block_cast_1d`: ``fp8 * scale_inv`` per tile in float32, rounded once
    to ``out_dtype``; ``data`` is ``[R, C]``."""
    r, c = data.shape
    n = BLOCK_SCALING_BLOCK_LEN
    cb = -(-c // n)
    s = scale_inv[:cb, :r].t().float()  # [R, Cb]
    v = fp8_to_float32(data)
    if cb * n != c:
        v = torch.nn.functional.pad(v, (0, cb * n - c))
    value = (v.reshape(r, cb, n) * s.unsqueeze(-1)).reshape(r, cb * n)[:, :c]
    return value.contiguous() if out_dtype == torch.float32 else value.to(out_dtype)


def block_dequantize_2d(
    data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`block_cast_2d` (``data`` is ``[R, C]``)."""
    r, c = data.shape
    n = BLOCK_SCALING_BLOCK_LEN
    rb, cb = -(-r // n), -(-c // n)
    s = scale_inv[:rb, :cb].float()
    v = torch.nn.functional.pad(fp8_to_float32(data), (0, cb * n - c, 0, rb * n - r))
    value = (v.reshape(rb, n, cb, n) * s.reshape(rb, 1, cb, 1)).reshape(rb * n, cb * n)
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
    a: torch.Tensor, fp8_dtype, *, two_d: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 cast of the matrix ``a [R, C]``: ``(data [R, C] FP8, exponents)``.

    1x32 blocks along ``C`` (``exponents [R, ceil(C/32)]``), or with ``two_d`` 32x32 blocks
    (``exponents [ceil(R/32), ceil(C/32)]``). Partial blocks are zero-padded for the amax.
    """
    r, c = a.shape
    n = MXFP8_BLOCK_LEN
    rows = n if two_d else 1
    v = a.detach().float()
    pad_r, pad_c = round_up(r, rows) - r, round_up(c, n) - c
    if pad_r or pad_c:
        v = torch.nn.functional.pad(v, (0, pad_c, 0, pad_r))
    rb, cb = v.shape[0] // rows, v.shape[1] // n
    blocks = v.reshape(rb, rows, cb, n)
    e = mxfp8_scale_exponent(_block_amax(blocks, (1, 3)), fp8_dtype)
    scaled = blocks * _e8m0_multiplier(e).reshape(rb, 1, cb, 1)
    data = _saturating_cast(scaled, fp8_dtype).reshape(rb * rows, cb * n)[:r, :c]
    return data.contiguous(), e


def mxfp8_dequantize(
    data: torch.Tensor, exponents: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`mxfp8_cast` with 1x32 blocks: ``fp8 * 2^(e-127)`` in float32, rounded
    once to ``out_dtype``; ``data`` is ``[R, C]``, ``exponents`` at least ``[R, ceil(C/32)]``."""
    r, c = data.shape
    n = MXFP8_BLOCK_LEN
    cb = -(-c // n)
    s = _e8m0_value(exponents[:r, :cb])
    v = fp8_to_float32(data)
    if cb * n != c:
        v = torch.nn.functional.pad(v, (0, cb * n - c))
    value = (v.reshape(r, cb, n) * s.unsqueeze(-1)).reshape(r, cb * n)[:, :c]
    return value.contiguous() if out_dtype == torch.float32 else value.to(out_dtype)
