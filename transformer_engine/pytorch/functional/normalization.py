"""The normalizations as functions: ``layernorm``, ``rmsnorm`` and ``l2_normalize`` (with
``l2_normalize_backward``), and the argument rules the norm modules and the norm operations
share (``normalized_dims``, ``check_eps``).

``layernorm`` and ``rmsnorm`` normalize over the trailing ``weight.dim()`` dimensions of the input, as
``torch.nn.functional.layer_norm`` does with ``normalized_shape = weight.shape``: a 1-D weight
normalizes the last dimension, a ``(heads, head_dim)`` weight the last two together.

``layernorm`` and ``rmsnorm`` are pure functions: they hold no state, differentiate through
autograd, and run on whatever device their input lives on. ``te.LayerNorm`` / ``te.RMSNorm``,
the fused norm of ``LayerNormLinear`` / ``LayerNormMLP`` and ``te.ops.LayerNorm`` /
``te.ops.RMSNorm`` all use them.

Precision: the statistics and the affine transform are computed in float32 (float64 inputs stay
in float64), whatever the dtype of the input or the parameters, and the result is rounded once
to the input's dtype. Gradients come back in the dtype of the tensor they belong to. Both run
as one autograd node each over fused kernels (:mod:`._fused_norms`): no float32 copy of the
input is kept for backward, which saves only the input and the per-row statistics.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Sequence

import torch

from ..device import check_same_device, reject_meta
from . import _fused_norms
from ._fused_norms import (
    NormState,
    fused_layernorm,
    fused_rmsnorm,
    norm_backward,
    norm_forward,
    norm_forward_fp8,
    norm_to_fp8,
)

__all__ = [
    "layernorm",
    "rmsnorm",
    "l2_normalize",
    "l2_normalize_backward",
    "normalized_dims",
    "check_eps",
    "norm_forward_with_state",
    "norm_forward_fp8_with_state",
    "norm_backward",
    "NormState",
    "norm_to_fp8",
    "norm_kernels_write_fp8",
]


def _check_operands(
    op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> None:
    """Types, shapes, dtypes, then placement: every check runs before any computation."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(
                f"{op}: {name} has dtype {t.dtype}; normalization needs a floating-point dtype"
            )
    if weight.dim() == 0:
        raise ValueError(
            f"{op}: weight must have the normalized shape (one value per feature), got a scalar"
        )
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension (the features), got a scalar")
    if weight.dim() == 1 and x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"{op}: the last dimension of x has size {x.shape[-1]} but weight has size "
            f"{weight.shape[0]}; the normalized (last) dimension of x must match the weight"
        )
    if x.shape[max(x.dim() - weight.dim(), 0) :] != weight.shape or x.dim() < weight.dim():
        raise ValueError(
            f"{op}: x has shape {tuple(x.shape)}, whose trailing dimensions must equal the "
            f"weight's shape {tuple(weight.shape)} (the normalized shape)"
        )
    if bias is not None and bias.shape != weight.shape:
        raise ValueError(
            f"{op}: bias has shape {tuple(bias.shape)} but weight has shape "
            f"{tuple(weight.shape)}; they must match"
        )
    if not eps >= 0:  # also refuses NaN
        raise ValueError(f"{op}: eps must be a non-negative number, got {eps!r}")
    # All-meta operands are allowed: they propagate shapes without data (tracing). A mix of meta
    # and materialized tensors is a deferred-initialization mistake, named as such.
    if not (x.is_meta and weight.is_meta and (bias is None or bias.is_meta)):
        reject_meta(op, x=x, weight=weight, bias=bias)
    check_same_device(op, "x", x, weight=weight, bias=bias)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # Statistics in reduced precision lose too much (BF16 has 8 mantissa bits): at least float32.
    return torch.promote_types(x.dtype, torch.float32)


def layernorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    zero_centered_gamma: bool = False,
) -> torch.Tensor:
    r"""Layer normalization over the trailing ``weight.dim()`` dimensions of ``x``.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \varepsilon}} \cdot \gamma + \beta

    with the biased variance, :math:`\gamma` = ``weight`` (``1 + weight`` when
    ``zero_centered_gamma``) and :math:`\beta` = ``bias``.

    Parameters
    ----------
    x : torch.Tensor
        Input of shape ``(..., *normalized_shape)``, any floating-point dtype.
    weight : torch.Tensor
        Scale of shape ``normalized_shape`` (e.g. ``(hidden,)``) on ``x``'s device.
    bias : torch.Tensor or None
        Shift of the weight's shape on ``x``'s device; ``None`` for no shift.
    eps : float
        Added to the variance for numerical stability; non-negative.
    zero_centered_gamma : bool, default = `False`
        Whether ``weight`` stores :math:`\gamma - 1` (the norm then scales by ``1 + weight``).

    Returns
    -------
    torch.Tensor
        Same shape, dtype and device as ``x``. Computed in float32 (float64 for float64 inputs)
        and cast back to ``x.dtype``; differentiable with respect to all tensor arguments.

    Raises
    ------
    TypeError
        A non-tensor argument or a non-floating-point dtype.
    ValueError
        Mismatched sizes, a negative ``eps``, meta tensors mixed with materialized ones, or
        tensors on different devices.
    """
    _check_operands("layernorm", x, weight, bias, eps)
    return fused_layernorm(x, weight, bias, eps, zero_centered_gamma)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered_gamma: bool = False,
) -> torch.Tensor:
    r"""Root-mean-square normalization over the trailing ``weight.dim()`` dimensions of ``x``.

    .. math::
        y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \varepsilon}} \cdot \gamma

    with :math:`\gamma` = ``weight`` (``1 + weight`` when ``zero_centered_gamma``).

    Parameters
    ----------
    x : torch.Tensor
        Input of shape ``(..., *normalized_shape)``, any floating-point dtype.
    weight : torch.Tensor
        Scale of shape ``normalized_shape`` (e.g. ``(hidden,)``) on ``x``'s device.
    eps : float
        Added to the mean square for numerical stability; non-negative.
    zero_centered_gamma : bool, default = `False`
        Whether ``weight`` stores :math:`\gamma - 1` (the norm then scales by ``1 + weight``).

    Returns
    -------
    torch.Tensor
        Same shape, dtype and device as ``x``. Computed in float32 (float64 for float64 inputs)
        and cast back to ``x.dtype``; differentiable with respect to ``x`` and ``weight``.

    Raises
    ------
    TypeError
        A non-tensor argument or a non-floating-point dtype.
    ValueError
        Mismatched sizes, a negative ``eps``, meta tensors mixed with materialized ones, or
        tensors on different devices.
    """
    _check_operands("rmsnorm", x, weight, None, eps)
    return fused_rmsnorm(x, weight, eps, zero_centered_gamma)


def norm_forward_with_state(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
    *,
    rms: bool,
) -> tuple[torch.Tensor, tuple, NormState]:
    """:func:`layernorm` (or :func:`rmsnorm` with ``rms``) without autograd, for callers that
    run their own backward (the te.ops norms): ``(y, tensors, state)``, where ``tensors`` are
    to be saved for backward and ``norm_backward(grad, tensors, state, needs)`` returns
    ``(dx, dweight, dbias)``. Same checks, kernels and bits as the autograd functions."""
    _check_operands("rmsnorm" if rms else "layernorm", x, weight, bias, eps)
    return norm_forward(x, weight, bias, eps, zero_centered_gamma, rms=rms)


def norm_kernels_write_fp8() -> bool:
    """Whether the norms in front of an FP8 GEMM (``te.LayerNormLinear``, ``te.LayerNormMLP``,
    te.ops ``ForwardNormCast``) write its FP8 input themselves: with the package's norm kernels
    (``NVTE_NORM_KERNELS=native``), which cast in their own pass. Otherwise they keep the norm
    followed by the GEMM's cast, which PyTorch's norm kernels make faster (and which costs less
    host time than routing the cast through the norm's autograd node)."""
    return _fused_norms.use_native_norm_kernels


def norm_forward_fp8_with_state(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
    *,
    rms: bool,
    quantizer,
    columnwise: bool,
) -> tuple[object, tuple, NormState]:
    """:func:`norm_forward_with_state` with the output written in FP8 by ``quantizer`` (a
    per-tensor FP8 quantizer that takes produced tensors), in the norm kernel's own pass where
    the native kernels run: the same bytes as the norm followed by the quantizer's cast."""
    _check_operands("rmsnorm" if rms else "layernorm", x, weight, bias, eps)
    return norm_forward_fp8(
        x, weight, bias, eps, zero_centered_gamma, rms=rms, quantizer=quantizer,
        columnwise=columnwise,
    )  # fmt: skip


def l2_normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""L2 normalization over the last dimension of ``x``, without parameters.

    .. math::
        y = \frac{x}{\sqrt{\sum_i x_i^2 + \varepsilon}}

    Returns ``(y, rsqrt_norm)``: ``y`` in ``x``'s dtype and shape, and the reciprocal norm
    :math:`(\sum_i x_i^2 + \varepsilon)^{-1/2}` of shape ``(..., 1)`` in the compute dtype
    (float32, float64 for float64 inputs), which :func:`l2_normalize_backward` takes.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"l2_normalize: x must be a floating-point tensor, got {x!r:.80}")
    if x.dim() == 0:
        raise ValueError("l2_normalize: x must have at least one dimension (the features)")
    if not eps >= 0:  # also refuses NaN
        raise ValueError(f"l2_normalize: eps must be a non-negative number, got {eps!r}")
    x_c = x.to(_compute_dtype(x))
    rsqrt_norm = torch.rsqrt(x_c.square().sum(dim=-1, keepdim=True) + eps)
    return (x_c * rsqrt_norm).to(x.dtype), rsqrt_norm


def l2_normalize_backward(
    grad_output: torch.Tensor, x: torch.Tensor, rsqrt_norm: torch.Tensor
) -> torch.Tensor:
    r"""Gradient of :func:`l2_normalize` with respect to ``x`` (in ``x``'s dtype).

    With :math:`r = (\sum_i x_i^2 + \varepsilon)^{-1/2}` and :math:`y = x r`:
    :math:`\partial L / \partial x = r\,g - x\,r^3 \sum_i g_i x_i`.
    """
    dtype = rsqrt_norm.dtype
    g, x_c = grad_output.to(dtype), x.to(dtype)
    dot = (g * x_c).sum(dim=-1, keepdim=True)
    return (rsqrt_norm * g - x_c * rsqrt_norm.pow(3) * dot).to(x.dtype)


# --- Argument rules shared by the norm modules and operations -------------------------------------


def normalized_dims(
    owner: str,
    normalized_shape: int | Sequence[int] | None,
    hidden_size: int | None,
) -> tuple[int, ...]:
    """The normalized shape, as a tuple of positive ints, from ``normalized_shape`` (an int or a
    non-empty sequence of ints: the trailing dimensions normalized together) or its deprecated
    alias ``hidden_size``."""
    if hidden_size is not None:
        warnings.warn(
            f"{owner}: hidden_size is deprecated; pass normalized_shape instead",
            DeprecationWarning,
            stacklevel=3,
        )
        if normalized_shape is not None:
            raise TypeError(
                f"{owner}: got both normalized_shape={normalized_shape!r} and "
                f"hidden_size={hidden_size!r}; pass normalized_shape only"
            )
        normalized_shape = hidden_size
    if normalized_shape is None:
        raise TypeError(f"{owner}: normalized_shape is required (the size of the last dimension)")
    if isinstance(normalized_shape, (tuple, list, torch.Size)):
        if len(normalized_shape) == 0:
            raise ValueError(
                f"{owner}: normalized_shape=() names no dimension; pass at least one size"
            )
        sizes = tuple(normalized_shape)
    else:
        sizes = (normalized_shape,)
    dims = []
    for size in sizes:
        if isinstance(size, bool):
            raise TypeError(f"{owner}: normalized_shape must be an int, got {size!r}")
        try:
            size = operator.index(size)
        except TypeError:
            raise TypeError(
                f"{owner}: normalized_shape must be an int or a sequence of ints, "
                f"got {normalized_shape!r}"
            ) from None
        if size <= 0:
            raise ValueError(f"{owner}: normalized_shape must be positive, got {size}")
        dims.append(size)
    return tuple(dims)


def check_eps(owner: str, eps: float) -> float:
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: eps must be a number, got {eps!r}") from None
    if not value >= 0:
        raise ValueError(f"{owner}: eps must be non-negative, got {eps!r}")
    return value
