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
    "scale_from_amax",
    "compute_scale_from_amax",
    "delayed_scaling_update",
]

FP8_CANONICAL_NAN = 0x7F
FLOAT32_MAX = torch.finfo(torch.float32).max
_E4M3_TO_FP16_MASK = -16385  # 0xBFFF as a signed int16
# Inputs whose float32 upcast is exact (and cheap): the cast multiplies in float32 after it.
SIGN_AND_EXPONENT_MASK = -8388608  # 0xFF800000 as a signed int32: clears a float32's mantissa
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

    Off the CPU torch's upcast is itself one fast kernel, and finding the largest byte would
    wait for the device (which a CUDA-graph capture forbids): there it runs (``factor`` 1).
    """
    if data.dtype == torch.float8_e5m2:
        nan_bytes, shift, factor = (125, 253), 8, 1.0
    elif data.dtype == torch.float8_e4m3fn:
        nan_bytes, shift, factor = (127, 255), 7, 256.0
    else:
        raise TypeError(f"fp8_to_float32: data has dtype {data.dtype}; pass an FP8 tensor")
    if data.device.type != "cpu":
        return data.float(), 1.0
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
    return scale_from_amax(amax_value, _fp8_max(fp8_dtype), epsilon, force_pow_2_scales)


def scale_from_amax(
    amax_value: torch.Tensor,
    max_value: float,
    epsilon: float = 0.0,
    force_pow_2_scales: bool = False,
) -> torch.Tensor:
    """:func:`compute_scale_from_amax` with the format's maximum given as a number
    (``multi_tensor_compute_scale_and_scale_inv`` takes it so)."""
    a = amax_value.detach().float().reshape(1).clone()
    eps = torch.tensor(float(epsilon), dtype=torch.float32, device=a.device)
    a = torch.where(a < eps, eps, a)
    limit = torch.tensor(float(max_value), dtype=torch.float32, device=a.device)
    bad = (a == 0) | torch.isinf(a) | torch.isnan(a)
    scale = torch.where(bad, torch.ones_like(a), limit / torch.where(bad, torch.ones_like(a), a))
    scale = torch.where(torch.isposinf(scale), torch.full_like(scale, FLOAT32_MAX), scale)
    if force_pow_2_scales:
        scale = (scale.view(torch.int32) & SIGN_AND_EXPONENT_MASK).view(torch.float32)
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
