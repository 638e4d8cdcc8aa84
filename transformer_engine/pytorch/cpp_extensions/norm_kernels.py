"""The native LayerNorm and RMSNorm kernels (``common/normalization/``, ``normalization.h``).

The formulas are those of :mod:`.normalization` (module docstring), computed in float32
registers from the input's dtype, with ``rsigma = rsqrtf(var + eps)``; the statistics are
float32 of shape ``[rows]`` (``rows`` = the product of all but the last dimension).

* :func:`norm_forward`: ``y`` in ``x``'s dtype, with the mean (LayerNorm) and ``rsigma``.
* :func:`norm_forward_fp8`: ``y`` rounded to ``x``'s dtype, then cast to FP8 with ``scale``
  exactly as :func:`.cast.quantize` casts (the bytes of "norm, then quantize"), with the amax of
  the rounded values max-accumulated, ``1 / scale`` and optionally the transposed copy.
* :func:`norm_amax`: only the amax of those rounded values (current scaling's first pass), and
  optionally the statistics, from which :func:`norm_forward_fp8_from_stats` writes both FP8
  copies (its second pass).
* :func:`norm_backward`: ``dx`` in ``x``'s dtype and ``dgamma`` (``dbeta``) in the weight's
  dtype, summed over the rows in float32 in a fixed order (deterministic).

These are CUDA-only entry points with no reference path: each validates its arguments first
(raising ``TypeError``/``ValueError``/``DevicePlacementError`` that name the value and the fix),
then returns ``None`` when the call cannot run natively (``x`` not on a CUDA device, or the
native library unavailable, which warns once as the other wrappers do); the caller then runs
its PyTorch path. ``x`` (and ``dz``) are made contiguous and 16-byte aligned (copied where
they are not, so their bits do not depend on where they start); the weight and bias must be 1-D
contiguous tensors of ``H`` elements in float32 or ``x``'s dtype (both in one dtype).
``zero_centered_gamma`` applies ``1 + weight``, formed in float32.
"""

from __future__ import annotations

import math

import torch

from ..constants import FP8_DTYPES, HIGH_PRECISION_DTYPES
from ._routing import launch_args, native_for, tensor_arg
from ._validation import check_dtype, check_fp32_scalar, check_tensor, check_tensors_on
from .cast import QuantizeResult, transposed_shape

__all__ = [
    "norm_forward",
    "norm_forward_fp8",
    "norm_amax",
    "norm_forward_fp8_from_stats",
    "stats_buffers",
    "norm_backward",
    "norm_backward_prevalidated",
    "norm_backward_workspace_elements",
    "norm_forward_prevalidated",
]


def _check_common(op: str, x, weight, bias, eps, zero_centered_gamma, rms) -> float:
    """Validates the forward's arguments (and the backward's x / weight); returns ``eps``."""
    check_tensor(op, "x", x)
    check_dtype(op, "x", x, HIGH_PRECISION_DTYPES)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(
            f"{op}: x has shape {tuple(x.shape)}; it needs a non-empty last dimension (the "
            "features)"
        )
    hidden = x.shape[-1]
    if not isinstance(rms, bool):
        raise TypeError(f"{op}: rms must be a bool (True: RMSNorm), got {rms!r}")
    if not isinstance(zero_centered_gamma, bool):
        raise TypeError(
            f"{op}: zero_centered_gamma must be a bool, got {zero_centered_gamma!r}; pass True "
            "when the weight stores (gamma - 1)"
        )
    if rms and bias is not None:
        raise ValueError(f"{op}: RMSNorm has no bias; pass bias=None")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        check_tensor(op, name, t)
        if t.dtype not in (torch.float32, x.dtype):
            raise TypeError(
                f"{op}: {name} has dtype {t.dtype}; expected torch.float32 or x's dtype "
                f"{x.dtype}; pass {name}.float()"
            )
        if t.dim() != 1 or t.shape[0] != hidden:
            raise ValueError(
                f"{op}: {name} has shape {tuple(t.shape)}; expected ({hidden},), one value per "
                f"feature of x's last dimension (x has shape {tuple(x.shape)})"
            )
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} is not contiguous; pass {name}.contiguous()")
    if bias is not None and bias.dtype != weight.dtype:
        raise TypeError(
            f"{op}: bias has dtype {bias.dtype} but weight has {weight.dtype}; pass both in one "
            "dtype"
        )
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: eps must be a number, got {eps!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    return value


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def stats_buffers(x: torch.Tensor, rms: bool):
    """``(mean or None, rsigma)``: uninitialized float32 statistics for ``x``'s rows (``mean``
    ``None`` for RMSNorm), for :func:`norm_amax` to fill."""
    rows = _rows(x)
    mean = None if rms else torch.empty(rows, dtype=torch.float32, device=x.device)
    return mean, torch.empty(rows, dtype=torch.float32, device=x.device)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and starting on a 16-byte boundary (a copy where it does not): the
    kernels take 16-byte vector loads only from aligned rows and run a looped kernel, which
    sums in another order, otherwise, so an input that is a view at an odd offset would give
    other bits than the same values in their own allocation."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _native(op: str, x: torch.Tensor):
    """The binding when ``x`` can run natively (a CUDA tensor and the library loaded)."""
    return native_for(op, x.device)


def norm_forward(x, weight, bias, eps, zero_centered_gamma, *, rms: bool):
    """``(y, mean or None, rsigma)``: ``y`` in ``x``'s dtype and shape; ``None`` when not
    native (see the module docstring)."""
    op = "norm_forward"
    eps = _check_common(op, x, weight, bias, eps, zero_centered_gamma, rms)
    check_tensors_on(op, "x", x, weight=weight, bias=bias)
    return norm_forward_prevalidated(x, weight, bias, eps, zero_centered_gamma, rms=rms)


def norm_forward_prevalidated(x, weight, bias, eps: float, zero_centered_gamma: bool, *,
                              rms: bool):  # fmt: skip
    """:func:`norm_forward` for callers that checked its arguments themselves (the norms of
    ``functional``, which run at every step of every LayerNorm* module): the Python checks
    would cost more host time than PyTorch's whole norm call. The native entry point still
    checks dtypes, shapes and devices."""
    native = _native("norm_forward", x)
    if native is None:
        return None
    x = _aligned(x)
    y = torch.empty_like(x)
    mean, rsigma = stats_buffers(x, rms)
    native.norm_forward(
        tensor_arg(x), tensor_arg(weight), tensor_arg(bias), eps, zero_centered_gamma, rms,
        tensor_arg(y), None, None, None, None, tensor_arg(mean), tensor_arg(rsigma),
        *launch_args(x.device),
    )  # fmt: skip
    return y, mean, rsigma


def _check_fp8(op: str, x, scale, fp8_dtype, amax) -> None:
    check_fp32_scalar(op, "scale", scale)
    if scale is None:
        raise TypeError(f"{op}: scale must be a one-element float32 tensor, got None")
    check_fp32_scalar(op, "amax", amax)
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(
            f"{op}: fp8_dtype={fp8_dtype!r} is not an FP8 format; use torch.float8_e4m3fn or "
            "torch.float8_e5m2"
        )


def _fp8_outputs(x, fp8_dtype, with_transpose: bool):
    """``(out, out_t or None, scale_inv)``, uninitialized, for an FP8 output of ``x``."""
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    out_t = None
    if with_transpose:
        out_t = torch.empty(transposed_shape(x.shape), dtype=fp8_dtype, device=x.device)
    return out, out_t, torch.empty(1, dtype=torch.float32, device=x.device)


def norm_forward_fp8(x, weight, bias, eps, zero_centered_gamma, *, rms: bool, scale,
                     fp8_dtype, amax=None, with_transpose: bool = False):  # fmt: skip
    """``(QuantizeResult(out, out_t or None, scale_inv), mean or None, rsigma)``: the norm
    rounded to ``x``'s dtype and cast to ``fp8_dtype`` with ``scale`` (one float32 element on
    ``x``'s device); ``amax`` (optional, one float32 element) is max-accumulated with the
    rounded values' ``max |y|``; ``out_t`` is the ``(H, *leading)`` transposed copy when
    ``with_transpose``. ``None`` when not native."""
    op = "norm_forward_fp8"
    eps = _check_common(op, x, weight, bias, eps, zero_centered_gamma, rms)
    _check_fp8(op, x, scale, fp8_dtype, amax)
    check_tensors_on(op, "x", x, weight=weight, bias=bias, scale=scale, amax=amax)
    native = _native(op, x)
    if native is None:
        return None
    x = _aligned(x)
    device = x.device
    out, out_t, scale_inv = _fp8_outputs(x, fp8_dtype, with_transpose)
    mean, rsigma = stats_buffers(x, rms)
    native.norm_forward(
        tensor_arg(x), tensor_arg(weight), tensor_arg(bias), eps, zero_centered_gamma, rms,
        tensor_arg(out), tensor_arg(scale), tensor_arg(out_t), tensor_arg(amax),
        tensor_arg(scale_inv), tensor_arg(mean), tensor_arg(rsigma), *launch_args(device),
    )  # fmt: skip
    return QuantizeResult(out, out_t, scale_inv), mean, rsigma


def norm_amax(x, weight, bias, eps, zero_centered_gamma, *, rms: bool, amax, mean=None,
              rsigma=None):  # fmt: skip
    """Overwrites ``amax`` (one float32 element on ``x``'s device) with ``max |y|`` of the
    values :func:`norm_forward_fp8` casts, and ``mean`` (LayerNorm) and ``rsigma`` (float32,
    one per row) with the statistics where given; returns ``amax``, or ``None`` when not
    native."""
    op = "norm_amax"
    eps = _check_common(op, x, weight, bias, eps, zero_centered_gamma, rms)
    check_fp32_scalar(op, "amax", amax)
    if amax is None:
        raise TypeError(f"{op}: amax must be a one-element float32 tensor, got None")
    _check_stats_out(op, x, mean, rsigma, rms, required=False)
    check_tensors_on(op, "x", x, weight=weight, bias=bias, amax=amax, mean=mean, rsigma=rsigma)
    native = _native(op, x)
    if native is None:
        return None
    x = _aligned(x)
    native.norm_amax(
        tensor_arg(x), tensor_arg(weight), tensor_arg(bias), eps, zero_centered_gamma, rms,
        tensor_arg(amax), tensor_arg(mean), tensor_arg(rsigma), *launch_args(x.device),
    )  # fmt: skip
    return amax


def _check_stats_out(op: str, x, mean, rsigma, rms: bool, *, required: bool) -> None:
    """The statistics buffers: float32, contiguous, one element per row of ``x``; ``mean``
    ``None`` for RMSNorm. Optional (both ``None``) unless ``required``."""
    if rms and mean is not None:
        raise ValueError(f"{op}: RMSNorm has no mean; pass mean=None")
    if not required and mean is None and rsigma is None:
        return
    if rsigma is None or (not rms and mean is None):
        raise ValueError(
            f"{op}: pass rsigma{'' if rms else ' and mean'} (float32, one per row of x), or neither"
        )
    for name, t in (("mean", mean), ("rsigma", rsigma)):
        if t is not None:
            _check_stat(op, name, t, _rows(x))
            if not t.is_contiguous():
                raise ValueError(f"{op}: {name} is not contiguous; pass {name}.contiguous()")


def norm_forward_fp8_from_stats(x, weight, bias, zero_centered_gamma, *, rms: bool, mean,
                                rsigma, scale, fp8_dtype, amax=None):  # fmt: skip
    """:func:`norm_forward_fp8` with the transposed copy, from the statistics (``mean`` for
    LayerNorm, ``rsigma``) that :func:`norm_amax` or the forward wrote for the same ``x``,
    weight, bias and eps: the same bytes, amax and ``scale_inv``, one read of ``x``. Returns
    ``QuantizeResult(out, out_t, scale_inv)``, or ``None`` when not native."""
    op = "norm_forward_fp8_from_stats"
    _check_common(op, x, weight, bias, 0.0, zero_centered_gamma, rms)
    _check_fp8(op, x, scale, fp8_dtype, amax)
    _check_stats_out(op, x, mean, rsigma, rms, required=True)
    check_tensors_on(op, "x", x, weight=weight, bias=bias, mean=mean, rsigma=rsigma,
                     scale=scale, amax=amax)  # fmt: skip
    native = _native(op, x)
    if native is None:
        return None
    x = _aligned(x)
    device = x.device
    out, out_t, scale_inv = _fp8_outputs(x, fp8_dtype, with_transpose=True)
    native.norm_forward_from_stats(
        tensor_arg(x), tensor_arg(weight), tensor_arg(bias), zero_centered_gamma, rms,
        tensor_arg(mean), tensor_arg(rsigma), tensor_arg(out), tensor_arg(scale),
        tensor_arg(out_t), tensor_arg(amax), tensor_arg(scale_inv), *launch_args(device),
    )  # fmt: skip
    return QuantizeResult(out, out_t, scale_inv)


def norm_backward_workspace_elements(rows: int, hidden: int, device) -> int | None:
    """Float32 elements of the backward's workspace on ``device`` (a CUDA device):
    ``2 * hidden * min(rows, 2 * SM count)``. ``None`` without the native library."""
    op = "norm_backward_workspace_elements"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        raise ValueError(f"{op}: device={device} has no index; pass the tensor's device")
    native = native_for(op, device)
    if native is None:
        return None
    return native.norm_backward_workspace_elements(rows, hidden, device.index)


def _check_stat(op: str, name: str, t, rows: int) -> None:
    check_tensor(op, name, t)
    if t.dtype != torch.float32:
        raise TypeError(
            f"{op}: {name} has dtype {t.dtype}; pass the float32 statistics the forward returned"
        )
    if t.numel() != rows:
        raise ValueError(
            f"{op}: {name} has {t.numel()} elements; expected {rows}, one per row of x (the "
            "forward's output)"
        )


def norm_backward(dz, x, mean, rsigma, weight, zero_centered_gamma, *, rms: bool,
                  with_dbeta: bool):  # fmt: skip
    """``(dx, dgamma, dbeta or None)`` from the forward's statistics: ``dx`` in ``x``'s dtype
    and shape, ``dgamma``/``dbeta`` (``with_dbeta``: LayerNorm only) in the weight's dtype.
    ``mean`` is ``None`` for RMSNorm. ``None`` when not native."""
    op = "norm_backward"
    _check_common(op, x, weight, None, 0.0, zero_centered_gamma, rms)
    check_tensor(op, "dz", dz)
    if dz.shape != x.shape or dz.dtype != x.dtype:
        raise ValueError(
            f"{op}: dz has shape {tuple(dz.shape)} and dtype {dz.dtype}; expected x's "
            f"{tuple(x.shape)} and {x.dtype}"
        )
    if rms:
        if mean is not None:
            raise ValueError(f"{op}: RMSNorm has no mean; pass mean=None")
        if with_dbeta:
            raise ValueError(f"{op}: RMSNorm has no bias; pass with_dbeta=False")
    else:
        _check_stat(op, "mean", mean, _rows(x))
    _check_stat(op, "rsigma", rsigma, _rows(x))
    check_tensors_on(op, "x", x, dz=dz, mean=mean, rsigma=rsigma, weight=weight)
    return norm_backward_prevalidated(
        dz, x, mean, rsigma, weight, zero_centered_gamma, rms=rms, with_dbeta=with_dbeta
    )


def norm_backward_prevalidated(dz, x, mean, rsigma, weight, zero_centered_gamma: bool, *,
                               rms: bool, with_dbeta: bool):  # fmt: skip
    """:func:`norm_backward` for callers that checked its arguments themselves (see
    :func:`norm_forward_prevalidated`)."""
    native = _native("norm_backward", x)
    if native is None:
        return None
    x, dz = _aligned(x), _aligned(dz)
    mean = mean.contiguous() if mean is not None else None
    rsigma = rsigma.contiguous()
    device = x.device
    hidden = x.shape[-1]
    dx = torch.empty_like(x)
    dgamma = torch.empty(hidden, dtype=weight.dtype, device=device)
    dbeta = torch.empty(hidden, dtype=weight.dtype, device=device) if with_dbeta else None
    elements = native.norm_backward_workspace_elements(_rows(x), hidden, device.index)
    workspace = torch.empty(max(elements, 1), dtype=torch.float32, device=device)
    native.norm_backward(
        tensor_arg(dz), tensor_arg(x), tensor_arg(mean), tensor_arg(rsigma), tensor_arg(weight),
        zero_centered_gamma, rms, tensor_arg(dx), tensor_arg(dgamma), tensor_arg(dbeta),
        tensor_arg(workspace), *launch_args(device),
    )  # fmt: skip
    return dx, dgamma, dbeta
