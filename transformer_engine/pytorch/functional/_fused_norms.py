"""LayerNorm and RMSNorm as single autograd nodes over fused kernels.

Forward reads the input in its own dtype and computes the statistics and the affine transform
in float32 (float64 for float64 input), rounding once to the input's dtype; backward keeps only
the input and the per-row statistics (no float32 copy of the input). The effective scale
``gamma`` (``weight``, or ``1 + weight`` with zero-centered gamma) is formed in float32 for
reduced-precision input, so ``1 + weight`` never rounds to BF16.

Kernels: PyTorch's ``native_layer_norm`` and ``_fused_rms_norm`` forward; backward through
``native_layer_norm_backward`` / ``_fused_rms_norm_backward`` on CUDA. Elsewhere the backward
runs the float32 formulas of ``cpp_extensions.normalization`` (``*_backward_from_stats``) (PyTorch's CPU LayerNorm backward accumulates the weight
gradient of BF16 input in reduced precision, and its fused RMSNorm backward is CUDA-only), as
are both directions of zero-centered gamma on CUDA with reduced-precision input (see
``_gamma``):

* ``xhat = (x - mean) * rstd`` (LayerNorm) or ``x * rstd`` (RMSNorm), ``dy = grad * gamma``;
* ``dx = rstd * (dy - mean(dy) - xhat * mean(dy * xhat))`` (RMSNorm without ``mean(dy)``);
* ``dgamma = sum_rows(grad * xhat)``, ``dbeta = sum_rows(grad)``.
"""

from __future__ import annotations

import torch

from ..cpp_extensions.normalization import (
    layernorm_backward_from_stats,
    rmsnorm_backward_from_stats,
)

__all__ = ["fused_layernorm", "fused_rmsnorm", "norm_forward", "norm_backward", "NormState"]

# Device types whose PyTorch has the fused RMSNorm forward (dropped after a failed call).
_FUSED_RMS_NORM = {"cpu", "cuda"}
_FUSED_RMS_NORM_BACKWARD = {"cuda"}  # PyTorch's CPU build has no fused RMSNorm backward


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _gamma(weight: torch.Tensor, x: torch.Tensor, zero_centered_gamma: bool):
    """``(gamma, fused)``: the effective scale, and whether the fused kernels can take it.

    The CPU kernels take float32 parameters with reduced-precision input (their mixed path,
    which computes everything in float32); the CUDA ones want the input's dtype, so there
    ``1 + weight`` (zero-centered gamma), which must not round to BF16, runs the float32
    formulas instead."""
    dtype = _compute_dtype(x.dtype)
    reduced = dtype != x.dtype
    fused = True
    if reduced and x.device.type != "cpu":
        if zero_centered_gamma:
            fused = False
        else:
            dtype = x.dtype
    gamma = weight if weight.dtype == dtype else weight.to(dtype)
    # Zero-centered gamma stores (gamma - 1) so that weight decay pulls the scale towards 1.
    return (gamma + 1 if zero_centered_gamma else gamma), fused


def _feature_dims(gamma: torch.Tensor) -> tuple[int, ...]:
    """The normalized (trailing) dimensions: as many as gamma has."""
    return tuple(range(-gamma.dim(), 0))


def _layernorm_forward(x, gamma, beta, eps, fused: bool):
    """``(y, mean, rstd)``; mean and rstd in the compute dtype, shaped to broadcast against x."""
    if fused:
        return torch.native_layer_norm(x, list(gamma.shape), gamma, beta, eps)
    dims = _feature_dims(gamma)
    x_c = x.to(_compute_dtype(x.dtype))
    mean = x_c.mean(dim=dims, keepdim=True)
    rstd = torch.rsqrt((x_c - mean).square().mean(dim=dims, keepdim=True) + eps)
    y = (x_c - mean) * rstd * gamma
    if beta is not None:
        y = y + beta
    return y.to(x.dtype), mean, rstd


def _rmsnorm_forward(x, gamma, eps, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` with rstd in the compute dtype, shaped to broadcast against x."""
    device_type = x.device.type
    if fused and device_type in _FUSED_RMS_NORM:
        try:
            return torch.ops.aten._fused_rms_norm(x, list(gamma.shape), gamma, eps)
        except (NotImplementedError, RuntimeError):  # a PyTorch build without the kernel
            _FUSED_RMS_NORM.discard(device_type)
    dims = _feature_dims(gamma)
    x_c = x.to(_compute_dtype(x.dtype))
    rstd = torch.rsqrt(x_c.square().mean(dim=dims, keepdim=True) + eps)
    return (x_c * rstd * gamma.to(x_c.dtype)).to(x.dtype), rstd


def _layernorm_backward(grad, x, gamma, mean, rstd, fused, has_bias, needs):
    needs_x, needs_w, needs_b = needs
    if x.is_cuda and fused:
        beta = torch.empty_like(gamma) if has_bias else None  # only its presence is read
        return torch.ops.aten.native_layer_norm_backward(
            grad.contiguous(), x, list(gamma.shape), mean, rstd, gamma, beta,
            [needs_x, needs_w, needs_b and has_bias],
        )  # fmt: skip
    return layernorm_backward_from_stats(
        grad, x, mean, rstd, gamma, need_dx=needs_x, need_dgamma=needs_w,
        need_dbeta=needs_b and has_bias,
    )  # fmt: skip


def _rmsnorm_backward(grad, x, gamma, rstd, fused, needs):
    needs_x, needs_w = needs[:2]
    if x.is_cuda and fused and "cuda" in _FUSED_RMS_NORM_BACKWARD:
        try:
            dx, dgamma = torch.ops.aten._fused_rms_norm_backward(
                grad.contiguous(), x, list(gamma.shape), rstd, gamma, [needs_x, needs_w]
            )
            return dx, dgamma, None
        except (NotImplementedError, RuntimeError):  # a PyTorch build without the kernel
            _FUSED_RMS_NORM_BACKWARD.discard("cuda")
    dx, dgamma = rmsnorm_backward_from_stats(
        grad, x, rstd, gamma, need_dx=needs_x, need_dgamma=needs_w
    )
    return dx, dgamma, None


class NormState:
    """What a norm's backward needs besides the saved tensors: which norm, which kernels ran
    the forward, and the dtypes the gradients go back in. The tensors themselves
    (``NormState.tensors``: input, effective scale, statistics) go through the caller's
    ``save_for_backward`` so saved-tensor hooks see them."""

    __slots__ = ("rms", "fused", "has_bias", "weight_dtype", "bias_dtype")

    def __init__(self, rms, fused, has_bias, weight_dtype, bias_dtype):
        self.rms, self.fused, self.has_bias = rms, fused, has_bias
        self.weight_dtype, self.bias_dtype = weight_dtype, bias_dtype


def norm_forward(x, weight, bias, eps: float, zero_centered_gamma: bool, *, rms: bool):
    """``(y, tensors, state)``: the norm of ``x`` (LayerNorm, or RMSNorm with ``rms``) and
    what :func:`norm_backward` takes (save ``tensors``, keep ``state``)."""
    gamma, fused = _gamma(weight, x, zero_centered_gamma)
    if rms:
        y, rstd = _rmsnorm_forward(x, gamma, eps, fused)
        tensors = (x, gamma, rstd)
    else:
        beta = None if bias is None else bias.to(gamma.dtype)
        y, mean, rstd = _layernorm_forward(x, gamma, beta, eps, fused)
        tensors = (x, gamma, mean, rstd)
    bias_dtype = None if bias is None else bias.dtype
    return y, tensors, NormState(rms, fused, bias is not None, weight.dtype, bias_dtype)


def norm_backward(grad, tensors, state: NormState, needs):
    """``(dx, dweight, dbias)`` from :func:`norm_forward`'s saved ``tensors`` and ``state``;
    ``needs`` says which of the three are wanted (``dbias`` is ``None`` for RMSNorm or
    without a bias), each in the dtype of the tensor it belongs to."""
    if state.rms:
        x, gamma, rstd = tensors
        dx, dgamma, dbeta = _rmsnorm_backward(grad, x, gamma, rstd, state.fused, needs)
    else:
        x, gamma, mean, rstd = tensors
        dx, dgamma, dbeta = _layernorm_backward(
            grad, x, gamma, mean, rstd, state.fused, state.has_bias, needs
        )
    return (
        None if dx is None else dx.to(x.dtype),
        None if dgamma is None else dgamma.to(state.weight_dtype),
        None if dbeta is None else dbeta.to(state.bias_dtype),
    )


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, zero_centered_gamma):  # noqa: D102
        y, tensors, ctx.state = norm_forward(x, weight, bias, eps, zero_centered_gamma, rms=False)
        ctx.save_for_backward(*tensors)
        return y

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        grads = norm_backward(grad, ctx.saved_tensors, ctx.state, ctx.needs_input_grad[:3])
        return (*grads, None, None)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered_gamma):  # noqa: D102
        y, tensors, ctx.state = norm_forward(x, weight, None, eps, zero_centered_gamma, rms=True)
        ctx.save_for_backward(*tensors)
        return y

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        needs = (*ctx.needs_input_grad[:2], False)
        dx, dweight, _ = norm_backward(grad, ctx.saved_tensors, ctx.state, needs)
        return dx, dweight, None, None


def fused_layernorm(x, weight, bias, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """LayerNorm over ``weight.dim()`` trailing dimensions (operands already checked)."""
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _LayerNorm.apply(x, weight, bias, eps, zero_centered_gamma)
    gamma, fused = _gamma(weight, x, zero_centered_gamma)
    beta = None if bias is None else bias.to(gamma.dtype)
    return _layernorm_forward(x, gamma, beta, eps, fused)[0]


def fused_rmsnorm(x, weight, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """RMSNorm over ``weight.dim()`` trailing dimensions (operands already checked)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps, zero_centered_gamma)
    gamma, fused = _gamma(weight, x, zero_centered_gamma)
    return _rmsnorm_forward(x, gamma, eps, fused)[0]
