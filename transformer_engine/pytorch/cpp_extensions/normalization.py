"""LayerNorm and RMSNorm forward and backward as upstream's kernel entry points.

``layernorm_fwd``, ``layernorm_bwd``, ``rmsnorm_fwd`` and ``rmsnorm_bwd`` take upstream's
positional arguments and return its lists, so code written against ``tex.layernorm_fwd`` /
``te.cpp_extensions.layernorm_fwd`` runs unchanged. They are explicit forward and backward
passes (no autograd): the forward returns the statistics the backward takes.

The input is viewed as ``[M, H]``: ``H`` is the size of the last dimension (the weight's only
dimension) and ``M`` the product of the others. With ``g`` the effective scale (``weight``, or
``1 + weight`` with ``zero_centered_gamma``), everything in float32:

* LayerNorm: ``mu = mean(x)``, ``rsigma = 1 / sqrt(mean((x - mu)^2) + eps)`` (biased
  variance), ``y = (x - mu) * rsigma * g + bias``.
* RMSNorm: ``rsigma = 1 / sqrt(mean(x^2) + eps)``, ``y = x * rsigma * g``.
* Backward, with ``xhat`` the normalized input (``(x - mu) * rsigma``, or ``x * rsigma``) and
  ``dy = dz * g``: ``dgamma = sum_rows(dz * xhat)``, ``dbeta = sum_rows(dz)``, and
  ``dx = rsigma * (dy - mean(dy) - xhat * mean(dy * xhat))`` for LayerNorm,
  ``dx = rsigma * (dy - xhat * mean(dy * xhat))`` for RMSNorm (row means over ``H``).

The backward formulas are also offered on their own, for any normalized shape and in the
statistics' dtype: :func:`layernorm_backward_from_stats` and
:func:`rmsnorm_backward_from_stats` (for the autograd nodes of ``functional``, where no fused
PyTorch backward applies).

The same math runs on every device as PyTorch operations (these entry points do not call the
native norm kernels of :mod:`.norm_kernels`); ``sm_margin`` (how many SMs upstream's kernels
leave free for communication) is therefore accepted, checked and has no effect. The
normalization modules do not call these: they differentiate through :mod:`transformer_engine.pytorch.functional.normalization`, which
computes the same formulas in the same precision.
"""

from __future__ import annotations

import operator

import torch

from ..constants import HIGH_PRECISION_DTYPES, DType, TE_DType_To_Torch
from ._validation import check_dtype, check_tensor, check_tensors_on

__all__ = [
    "layernorm_fwd",
    "layernorm_bwd",
    "rmsnorm_fwd",
    "rmsnorm_bwd",
    "rmsnorm_bwd_add",
    "layernorm_backward_from_stats",
    "rmsnorm_backward_from_stats",
]

_STATS_DTYPE = torch.float32


def _otype(op: str, otype) -> torch.dtype:
    """The torch dtype of upstream's ``otype`` (a ``DType``, its int value, or a torch dtype)."""
    try:
        dtype = TE_DType_To_Torch.get(DType.cast(otype))
    except (TypeError, ValueError):
        dtype = None
    if dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{op}: otype={otype!r} is not a high-precision element type; pass "
            "DType.kFloat32, DType.kFloat16 or DType.kBFloat16 (or the torch dtype), and a "
            "quantizer to get a quantized output"
        )
    return dtype


def _check_flags(op: str, sm_margin, zero_centered_gamma) -> None:
    if isinstance(sm_margin, bool):
        raise TypeError(f"{op}: sm_margin must be an int >= 0, got {sm_margin!r}")
    try:
        margin = operator.index(sm_margin)
    except TypeError:
        raise TypeError(f"{op}: sm_margin must be an int >= 0, got {sm_margin!r}") from None
    if margin < 0:
        raise ValueError(f"{op}: sm_margin must be >= 0, got {margin}")
    if not isinstance(zero_centered_gamma, bool):
        raise TypeError(
            f"{op}: zero_centered_gamma must be a bool, got {zero_centered_gamma!r}; pass "
            "True when the weight stores (gamma - 1)"
        )


def _check_eps(op: str, eps) -> float:
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: eps must be a number, got {eps!r}") from None
    if not value >= 0:  # also refuses NaN
        raise ValueError(f"{op}: eps must be a non-negative number, got {eps!r}")
    return value


def _check_params(op: str, x: torch.Tensor, params: dict) -> int:
    """``x`` and its 1-D per-feature parameters; returns ``H``."""
    check_tensor(op, "input", x)
    check_dtype(op, "input", x, HIGH_PRECISION_DTYPES)
    if x.dim() == 0:
        raise ValueError(f"{op}: input is 0-d; it needs a last dimension (the features)")
    hidden = x.shape[-1]
    if hidden == 0:
        raise ValueError(f"{op}: input has shape {tuple(x.shape)}, no features to normalize")
    for name, t in params.items():
        if t is None:
            continue
        check_tensor(op, name, t)
        check_dtype(op, name, t, HIGH_PRECISION_DTYPES)
        if t.dim() != 1 or t.shape[0] != hidden:
            raise ValueError(
                f"{op}: {name} has shape {tuple(t.shape)}; expected ({hidden},), one value per "
                f"feature of the input's last dimension (input shape {tuple(x.shape)})"
            )
    return hidden


def _check_stats(op: str, rows: int, stats: dict) -> None:
    for name, t in stats.items():
        check_tensor(op, name, t)
        if t.dtype != _STATS_DTYPE:
            raise TypeError(
                f"{op}: {name} has dtype {t.dtype}; the forward returns float32 statistics, "
                "pass those"
            )
        if t.numel() != rows:
            raise ValueError(
                f"{op}: {name} has {t.numel()} elements; expected {rows}, one per row of the "
                "input (the forward's output)"
            )


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    gamma = weight.to(_STATS_DTYPE)
    # Zero-centered gamma stores (gamma - 1) so that weight decay pulls the scale towards 1.
    return gamma + 1 if zero_centered_gamma else gamma


def _finish_output(op, y32, x, ln_out, quantizer, out_dtype):
    """``y32`` (float32, ``[M, H]``) as upstream's ``out``: quantized with ``quantizer`` when
    given (from the float32 values, as a fused norm-and-cast kernel does), else in
    ``out_dtype``; written into ``ln_out`` when given."""
    y32 = y32.reshape(x.shape)
    if quantizer is not None:
        if ln_out is not None:
            return quantizer.update_quantized(y32, ln_out)
        return quantizer.quantize_impl(y32, dtype=out_dtype)
    if ln_out is not None:
        return ln_out.copy_(y32)
    return y32.to(out_dtype)


def _check_ln_out(op, ln_out, x, quantizer, out_dtype) -> None:
    if ln_out is None:
        return
    if quantizer is None:
        check_tensor(op, "ln_out", ln_out)
        if ln_out.dtype != out_dtype:
            raise TypeError(
                f"{op}: ln_out has dtype {ln_out.dtype} but otype asks for {out_dtype}; pass a "
                "buffer of the output type"
            )
    if tuple(ln_out.shape) != tuple(x.shape):
        raise ValueError(
            f"{op}: ln_out has shape {tuple(ln_out.shape)}; expected the input's shape "
            f"{tuple(x.shape)}"
        )


def _check_quantizer(op: str, quantizer) -> None:
    if quantizer is not None and not (
        callable(getattr(quantizer, "quantize_impl", None))
        and callable(getattr(quantizer, "update_quantized", None))
    ):
        raise TypeError(
            f"{op}: quantizer must be a transformer_engine.pytorch Quantizer (e.g. "
            f"Float8Quantizer) or None, got {type(quantizer).__name__}"
        )


def layernorm_fwd(input, weight, bias, eps, ln_out, quantizer, otype, sm_margin,
                  zero_centered_gamma):  # fmt: skip
    """LayerNorm forward: ``[out, mu, rsigma]``.

    ``out`` has the input's shape: quantized with ``quantizer`` when one is given (from the
    float32 values; ``otype`` is then its nominal high-precision type), else in ``otype``
    (``DType.kFloat32/kFloat16/kBFloat16``); written into ``ln_out`` when that is not None.
    ``mu`` and ``rsigma`` are float32 of shape ``[M]``, for :func:`layernorm_bwd`. ``bias``
    may be None (no shift). See the module docstring for the formulas.
    """
    op = "layernorm_fwd"
    hidden = _check_params(op, input, {"weight": weight, "bias": bias})
    eps = _check_eps(op, eps)
    _check_flags(op, sm_margin, zero_centered_gamma)
    _check_quantizer(op, quantizer)
    out_dtype = _otype(op, otype)
    _check_ln_out(op, ln_out, input, quantizer, out_dtype)
    check_tensors_on(op, "input", input, weight=weight, bias=bias)

    x = input.reshape(-1, hidden).to(_STATS_DTYPE)
    mu = x.mean(dim=1)
    centered = x - mu[:, None]
    rsigma = torch.rsqrt(centered.square().mean(dim=1) + eps)
    y = centered * rsigma[:, None] * _gamma(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.to(_STATS_DTYPE)
    return [_finish_output(op, y, input, ln_out, quantizer, out_dtype), mu, rsigma]


def rmsnorm_fwd(input, weight, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
    """RMSNorm forward: ``[out, None, rsigma]`` (no mean), as :func:`layernorm_fwd` otherwise."""
    op = "rmsnorm_fwd"
    hidden = _check_params(op, input, {"weight": weight})
    eps = _check_eps(op, eps)
    _check_flags(op, sm_margin, zero_centered_gamma)
    _check_quantizer(op, quantizer)
    out_dtype = _otype(op, otype)
    _check_ln_out(op, ln_out, input, quantizer, out_dtype)
    check_tensors_on(op, "input", input, weight=weight)

    x = input.reshape(-1, hidden).to(_STATS_DTYPE)
    rsigma = torch.rsqrt(x.square().mean(dim=1) + eps)
    y = x * rsigma[:, None] * _gamma(weight, zero_centered_gamma)
    return [_finish_output(op, y, input, ln_out, quantizer, out_dtype), None, rsigma]


def _check_backward(op, dz, x, gamma, stats, sm_margin, zero_centered_gamma) -> int:
    hidden = _check_params(op, x, {"gamma": gamma})
    check_tensor(op, "dz", dz)
    check_dtype(op, "dz", dz, HIGH_PRECISION_DTYPES)
    if dz.shape != x.shape:
        raise ValueError(
            f"{op}: dz has shape {tuple(dz.shape)} but x has shape {tuple(x.shape)}; the "
            "output gradient has the input's shape"
        )
    _check_stats(op, x.numel() // hidden, stats)
    _check_flags(op, sm_margin, zero_centered_gamma)
    check_tensors_on(op, "x", x, dz=dz, gamma=gamma, **stats)
    return hidden


def _norm_dims(x: torch.Tensor, gamma: torch.Tensor):
    """``(feature dims, row dims)`` of ``x``: its last ``gamma.dim()`` dimensions, the rest."""
    if gamma.dim() == 0 or gamma.dim() > x.dim() or x.shape[x.dim() - gamma.dim() :] != gamma.shape:
        raise ValueError(
            f"norm backward: gamma has shape {tuple(gamma.shape)}; expected the trailing "
            f"(normalized) dimensions of x, shape {tuple(x.shape)}"
        )
    return tuple(range(-gamma.dim(), 0)), tuple(range(x.dim() - gamma.dim()))


def _sum_rows(t: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    return t.sum(dim=rows) if rows else t


def _stats_dtype(rstd: torch.Tensor) -> torch.dtype:
    """The backward's compute dtype: float64 for float64 statistics, else float32. Stated, not
    read off ``rstd``: under torch.compile the fake kernel of ``torch.native_layer_norm`` on
    the CPU reports 16-bit statistics for 16-bit input (the real kernel returns float32), and
    a traced backward would then compute in 16 bits."""
    return torch.float64 if rstd.dtype == torch.float64 else torch.float32


def layernorm_backward_from_stats(grad, x, mean, rstd, gamma, need_dx=True, need_dgamma=True,
                                  need_dbeta=True):  # fmt: skip
    """LayerNorm backward written out from the forward's statistics: ``(dx, dgamma, dbeta)``.

    The formulas of the module docstring over the last ``gamma.dim()`` dimensions of ``x``
    (the normalized shape may have several dimensions; every other dimension is a row).
    ``mean`` and ``rstd`` are shaped to broadcast against ``x`` (e.g. ``[..., 1]``); everything
    is computed in float32 (float64 for float64 statistics) and returned in it, unrounded; the
    caller casts. ``gamma`` is the effective
    scale (``1 + weight`` already applied for zero-centered gamma). A gradient not asked for
    (``need_* = False``) is ``None``. Only ``gamma``'s shape is checked (against ``x``'s
    trailing dimensions); callers validate the rest.
    """
    dims, rows = _norm_dims(x, gamma)
    dtype = _stats_dtype(rstd)
    mean, rstd = mean.to(dtype), rstd.to(dtype)
    g = grad.to(dtype)
    xhat = (x.to(dtype) - mean) * rstd
    dx = dgamma = dbeta = None
    if need_dx:
        dy = g * gamma.to(dtype)
        dx = rstd * (
            dy - dy.mean(dim=dims, keepdim=True) - xhat * (dy * xhat).mean(dim=dims, keepdim=True)
        )
    if need_dgamma:
        dgamma = _sum_rows(g * xhat, rows)
    if need_dbeta:
        dbeta = _sum_rows(g, rows)
    return dx, dgamma, dbeta


def rmsnorm_backward_from_stats(grad, x, rstd, gamma, need_dx=True, need_dgamma=True):
    """RMSNorm backward written out from the forward's ``rstd``: ``(dx, dgamma)``, with the
    conventions of :func:`layernorm_backward_from_stats` (no mean, no ``dbeta``)."""
    dims, rows = _norm_dims(x, gamma)
    dtype = _stats_dtype(rstd)
    rstd = rstd.to(dtype)
    g = grad.to(dtype)
    xhat = x.to(dtype) * rstd
    dx = dgamma = None
    if need_dx:
        dy = g * gamma.to(dtype)
        dx = rstd * (dy - xhat * (dy * xhat).mean(dim=dims, keepdim=True))
    if need_dgamma:
        dgamma = _sum_rows(g * xhat, rows)
    return dx, dgamma


def layernorm_bwd(dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma):
    """LayerNorm backward: ``[dx, dgamma, dbeta]`` from the forward's ``mu`` and ``rsigma``.

    ``dx`` has ``x``'s shape and dtype; ``dgamma`` and ``dbeta`` have ``gamma``'s shape and
    dtype (``dgamma`` is the gradient of the stored weight, the same with or without
    ``zero_centered_gamma``).
    """
    op = "layernorm_bwd"
    _check_backward(op, dz, x, gamma, {"mu": mu, "rsigma": rsigma}, sm_margin,
                    zero_centered_gamma)  # fmt: skip
    hidden = x.shape[-1]
    dx, dgamma, dbeta = layernorm_backward_from_stats(
        dz.reshape(-1, hidden), x.reshape(-1, hidden), mu.reshape(-1, 1), rsigma.reshape(-1, 1),
        _gamma(gamma, zero_centered_gamma),
    )  # fmt: skip
    return [dx.reshape(x.shape).to(x.dtype), dgamma.to(gamma.dtype), dbeta.to(gamma.dtype)]


def rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma):
    """RMSNorm backward: ``[dx, dgamma]`` from the forward's ``rsigma`` (dtypes as
    :func:`layernorm_bwd`)."""
    op = "rmsnorm_bwd"
    _check_backward(op, dz, x, gamma, {"rsigma": rsigma}, sm_margin, zero_centered_gamma)
    return _rmsnorm_bwd(dz, x, rsigma, gamma, zero_centered_gamma)


def rmsnorm_bwd_add(dz, x, add, rsigma, gamma, sm_margin, zero_centered_gamma):
    """RMSNorm backward with a gradient to add to ``dx`` (the residual branch's, when the norm's
    input also feeds a residual add): ``[dx + add, dgamma]``. The sum is taken in the backward's
    float32 before the one rounding to ``x``'s dtype."""
    op = "rmsnorm_bwd_add"
    _check_backward(op, dz, x, gamma, {"rsigma": rsigma}, sm_margin, zero_centered_gamma)
    check_tensor(op, "add", add)
    check_dtype(op, "add", add, HIGH_PRECISION_DTYPES)
    if add.shape != x.shape:
        raise ValueError(
            f"{op}: add has shape {tuple(add.shape)} but x has shape {tuple(x.shape)}; the "
            "added gradient has the input's shape"
        )
    check_tensors_on(op, "x", x, add=add)
    return _rmsnorm_bwd(dz, x, rsigma, gamma, zero_centered_gamma, add)


def _rmsnorm_bwd(dz, x, rsigma, gamma, zero_centered_gamma, add=None):
    """The checked RMSNorm backward on ``[rows, hidden]`` views; ``add`` joins ``dx`` before its
    rounding to ``x``'s dtype."""
    hidden = x.shape[-1]
    dx, dgamma = rmsnorm_backward_from_stats(
        dz.reshape(-1, hidden), x.reshape(-1, hidden), rsigma.reshape(-1, 1),
        _gamma(gamma, zero_centered_gamma),
    )  # fmt: skip
    if add is not None:
        dx = dx + add.reshape(-1, hidden).to(dx.dtype)
    return [dx.reshape(x.shape).to(x.dtype), dgamma.to(gamma.dtype)]
