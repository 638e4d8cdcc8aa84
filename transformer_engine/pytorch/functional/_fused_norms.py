"""LayerNorm and RMSNorm as single autograd nodes over fused kernels.

Forward reads the input in its own dtype and computes the statistics and the affine transform
in float32 (float64 for float64 input), rounding once to the input's dtype; backward keeps only
the input and the per-row statistics (no float32 copy of the input). The effective scale
``gamma`` (``weight``, or ``1 + weight`` with zero-centered gamma) is formed in float32 for
reduced-precision input, so ``1 + weight`` never rounds to BF16.

Kernels (``NORM_KERNELS``, from ``NVTE_NORM_KERNELS``): on CUDA, by default, the package's own
kernels of ``cpp_extensions.norm_kernels`` for bfloat16 and float16 input, forward and
backward; with ``NVTE_NORM_KERNELS=native`` also for float32 input, and they also write an FP8
output in their own pass (``use_native_norm_kernels``). Elsewhere (the CPU, ``NVTE_NORM_KERNELS=torch``, other dtypes)
the forward is PyTorch's ``native_layer_norm`` / ``_fused_rms_norm``, the backward PyTorch's
on CUDA and on the CPU the float32 formulas of ``cpp_extensions.normalization``
(``*_backward_from_stats``: PyTorch's CPU LayerNorm backward accumulates the weight gradient of
BF16 input in reduced precision, and its fused RMSNorm backward is CUDA-only); zero-centered
gamma with reduced-precision CUDA input runs those formulas both ways (see ``_gamma``):

* ``xhat = (x - mean) * rstd`` (LayerNorm) or ``x * rstd`` (RMSNorm), ``dy = grad * gamma``;
* ``dx = rstd * (dy - mean(dy) - xhat * mean(dy * xhat))`` (RMSNorm without ``mean(dy)``);
* ``dgamma = sum_rows(grad * xhat)``, ``dbeta = sum_rows(grad)``.
"""

from __future__ import annotations

import os

import torch

from ...common.native import native_module
from ..cpp_extensions import norm_kernels as native_norms
from ..cpp_extensions.cast import compute_amax, quantize_prevalidated
from ..cpp_extensions.normalization import (
    layernorm_backward_from_stats,
    rmsnorm_backward_from_stats,
)
from ._once_differentiable import once_differentiable

__all__ = [
    "fused_layernorm",
    "fused_rmsnorm",
    "norm_forward",
    "norm_forward_fp8",
    "norm_to_fp8",
    "norm_backward",
    "NormState",
]

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
    the forward, and the dtypes the gradients go back in. The tensors themselves (input,
    scale, statistics) go through the caller's ``save_for_backward`` so saved-tensor hooks
    see them.

    ``native``: the package's kernels ran (saved: the input as ``[rows, H]``, the weight, the
    statistics); the backward runs the native kernel on them and gives ``dx`` the input's
    ``shape`` back."""

    __slots__ = (
        "rms", "fused", "has_bias", "weight_dtype", "bias_dtype", "native", "shape",
        "zero_centered_gamma", "weight_dims",
    )  # fmt: skip

    def __init__(self, rms, fused, has_bias, weight_dtype, bias_dtype, native=False, shape=None,
                 zero_centered_gamma=False, weight_dims=1):  # fmt: skip
        self.rms, self.fused, self.has_bias = rms, fused, has_bias
        self.weight_dtype, self.bias_dtype = weight_dtype, bias_dtype
        self.native, self.shape, self.zero_centered_gamma = native, shape, zero_centered_gamma
        self.weight_dims = weight_dims


_NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The input dtypes ``auto`` gives the package's kernels: the 16-bit ones, where they were
# measured against PyTorch's (float32 input keeps PyTorch's kernels unless ``native``).
_AUTO_DTYPES = (torch.bfloat16, torch.float16)
# The longest rows ``auto`` gives the package's kernels: past 16384 features they run looped
# kernels that re-read each row per pass, slower than PyTorch's on an H200 (2048 x 32768 BF16:
# LayerNorm backward 0.15 of the copy against 0.36, forward 0.44 against 0.51).
_AUTO_MAX_HIDDEN = 16384


def _norm_kernels_setting() -> str:
    """``NVTE_NORM_KERNELS``: ``auto`` (the default), ``native`` or ``torch``."""
    value = os.environ.get("NVTE_NORM_KERNELS", "") or "auto"
    if value not in ("auto", "native", "torch"):
        raise ValueError(
            f"NVTE_NORM_KERNELS={value!r} is not a norm-kernel setting; use 'auto' (the "
            "default), 'native' or 'torch'"
        )
    return value


# Which kernels run the norms on CUDA (docs/performance_norms.md has the figures). By default
# (``auto``) the package's kernels compute the high-precision forward and the backward: on an
# H200 they move more bytes per second than PyTorch's at the hidden sizes of transformers.
# Before an FP8 GEMM the norm's high-precision output is then cast by the GEMM's quantizer,
# because the package's norm kernels writing FP8 themselves (``native``: with the transposed
# copy and the amax) measured slower than the norm followed by the cast+transpose kernel.
# ``torch`` keeps PyTorch's kernels throughout.
NORM_KERNELS = _norm_kernels_setting()
use_native_norm_kernels = NORM_KERNELS == "native"  # the norm kernels write the FP8 output
use_native_high_precision_norms = NORM_KERNELS != "torch"


def _native_operands(x, weight, bias):
    """``(x as [rows, H], weight, bias as 1-D)`` when the native kernels take these operands
    (CUDA; bfloat16 or float16 input, also float32 with ``native``; parameters in float32 or
    the input's dtype, both in one dtype), else ``None``."""
    if use_native_norm_kernels:
        dtypes = _NATIVE_DTYPES
    elif use_native_high_precision_norms:
        dtypes = _AUTO_DTYPES
    else:
        return None
    if not x.is_cuda or x.dtype not in dtypes:
        return None
    if x.numel() == 0:
        return None
    if weight.dtype not in (torch.float32, x.dtype) or not weight.is_contiguous():
        return None
    if bias is not None and (bias.dtype != weight.dtype or not bias.is_contiguous()):
        return None
    hidden = weight.numel()
    if hidden > _AUTO_MAX_HIDDEN and not use_native_norm_kernels:
        return None
    w = weight.view(hidden)
    return x.reshape(-1, hidden), w, None if bias is None else bias.view(hidden)


def _native_state(x, weight, bias, rms, zero_centered_gamma):
    return NormState(
        rms, True, bias is not None, weight.dtype, None if bias is None else bias.dtype,
        native=True, shape=x.shape, zero_centered_gamma=zero_centered_gamma,
        weight_dims=weight.dim(),
    )  # fmt: skip


def _saved(x2, w, mean, rsigma, rms):
    return (x2, w, rsigma) if rms else (x2, w, mean, rsigma)


def norm_forward(x, weight, bias, eps: float, zero_centered_gamma: bool, *, rms: bool):
    """``(y, tensors, state)``: the norm of ``x`` (LayerNorm, or RMSNorm with ``rms``) and
    what :func:`norm_backward` takes (save ``tensors``, keep ``state``)."""
    operands = _native_operands(x, weight, bias)
    if operands is not None:
        x2, w, b = operands
        result = native_norms.norm_forward_prevalidated(x2, w, b, eps, zero_centered_gamma, rms=rms)
        if result is not None:
            y, mean, rsigma = result
            state = _native_state(x, weight, bias, rms, zero_centered_gamma)
            return y.view(x.shape), _saved(x2, w, mean, rsigma, rms), state
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


def norm_forward_fp8(x, weight, bias, eps: float, zero_centered_gamma: bool, *, rms: bool,
                     quantizer, columnwise: bool):  # fmt: skip
    """The norm of ``x`` cast to FP8 by ``quantizer`` (a per-tensor FP8 quantizer that takes
    produced tensors: ``functional.produced_fp8.can_produce``), as ``(fp8, tensors, state)``
    like :func:`norm_forward`. ``fp8`` has ``x``'s shape (a tensor, or internal storage as the
    quantizer's ``internal`` says) with the row-wise bytes and, with ``columnwise``, the
    transposed copy ``[H, rows]``; its bytes are those of :func:`norm_forward` followed by the
    quantizer's cast (``x``'s last dimension must be the whole normalized size). Where the
    native kernels take the operands, the norm kernel writes the FP8 bytes itself (delayed
    scaling: in its one pass; current scaling: after its amax pass); elsewhere the norm runs,
    then the cast."""
    if weight.numel() != x.shape[-1]:
        raise ValueError(
            f"norm_forward_fp8: x has shape {tuple(x.shape)} but the weight normalizes "
            f"{weight.numel()} elements; the FP8 output needs the last dimension to be the "
            "whole normalized size"
        )
    operands = _native_operands(x, weight, bias) if use_native_norm_kernels else None
    if operands is not None and native_module() is not None:
        x2, w, b = operands
        produced = []
        stats = []  # current scaling: the statistics its amax pass wrote

        def produce(scale, amax, fp8_dtype, with_transpose):
            if stats and with_transpose:
                mean, rsigma = stats
                res = native_norms.norm_forward_fp8_from_stats(
                    x, w, b, zero_centered_gamma, rms=rms, mean=mean, rsigma=rsigma,
                    scale=scale, fp8_dtype=fp8_dtype, amax=amax,
                )  # fmt: skip
            else:
                res, mean, rsigma = native_norms.norm_forward_fp8(
                    x, w, b, eps, zero_centered_gamma, rms=rms, scale=scale,
                    fp8_dtype=fp8_dtype, amax=amax, with_transpose=with_transpose,
                )  # fmt: skip
            produced[:] = [_saved(x2, w, mean, rsigma, rms)]
            return res, None

        def amax_of(amax):  # current scaling's first pass, keeping the statistics
            mean, rsigma = native_norms.stats_buffers(x2, rms)
            native_norms.norm_amax(
                x2, w, b, eps, zero_centered_gamma, rms=rms, amax=amax, mean=mean, rsigma=rsigma
            )
            stats[:] = [mean, rsigma]

        state = _native_state(x, weight, bias, rms, zero_centered_gamma)
    else:
        produced = []

        def run_norm():
            if not produced:
                y, tensors, norm_state = norm_forward(
                    x, weight, bias, eps, zero_centered_gamma, rms=rms
                )
                produced[:] = [tensors, y, norm_state]
            return produced[1]

        def produce(scale, amax, fp8_dtype, with_transpose):
            y = run_norm()
            res = quantize_prevalidated(
                y, scale, fp8_dtype, amax=amax, with_transpose=with_transpose
            )
            return res, None

        def amax_of(amax):  # the amax the quantizer's own cast would take
            compute_amax(run_norm(), out=amax)

        state = None
    quantizer.set_usage(rowwise=True, columnwise=columnwise)
    out, _ = quantizer.quantize_produced(produce, x.shape, x.dtype, x.device, amax_of=amax_of)
    tensors = produced[0]
    return out, tensors, state if state is not None else produced[2]


class _NormToFP8(torch.autograd.Function):
    """The norm as an autograd node whose output is the FP8 tensor the next GEMM reads; its
    gradient comes back in high precision."""

    @staticmethod
    def forward(  # noqa: D102
        ctx, x, weight, bias, eps, zero_centered_gamma, rms, quantizer, columnwise
    ):
        internal, quantizer.internal = quantizer.internal, False
        try:
            out, tensors, ctx.state = norm_forward_fp8(
                x, weight, bias, eps, zero_centered_gamma, rms=rms, quantizer=quantizer,
                columnwise=columnwise,
            )  # fmt: skip
        finally:
            quantizer.internal = internal
        ctx.save_for_backward(*tensors)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # noqa: D102
        needs = ctx.needs_input_grad[:3]
        dx, dweight, dbias = norm_backward(grad, ctx.saved_tensors, ctx.state, needs)
        return dx, dweight, dbias, None, None, None, None, None


def norm_to_fp8(x, weight, bias, eps: float, zero_centered_gamma: bool, *, rms: bool,
                quantizer, columnwise: bool):  # fmt: skip
    """:func:`norm_forward_fp8` as a differentiable function of ``x``, ``weight`` and
    ``bias``: the FP8 tensor (a ``QuantizedTensor`` of ``x``'s shape) the next GEMM takes as
    it is; the gradient it receives flows back through the norm's backward."""
    return _NormToFP8.apply(x, weight, bias, eps, zero_centered_gamma, rms, quantizer, columnwise)


def norm_backward(grad, tensors, state: NormState, needs):
    """``(dx, dweight, dbias)`` from :func:`norm_forward`'s saved ``tensors`` and ``state``;
    ``needs`` says which of the three are wanted (``dbias`` is ``None`` for RMSNorm or
    without a bias), each in the dtype of the tensor it belongs to."""
    if state.native:
        return _native_backward(grad, tensors, state, needs)
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


def _native_backward(grad, tensors, state: NormState, needs):
    if state.rms:
        (x2, w, rsigma), mean = tensors, None
    else:
        x2, w, mean, rsigma = tensors
    needs_x, needs_w, needs_b = needs
    dz = grad.reshape(x2.shape)
    if dz.dtype != x2.dtype:
        dz = dz.to(x2.dtype)
    with_dbeta = state.has_bias and needs_b
    dx, dgamma, dbeta = native_norms.norm_backward_prevalidated(
        dz, x2, mean, rsigma, w, state.zero_centered_gamma, rms=state.rms, with_dbeta=with_dbeta
    )
    return (
        dx.view(state.shape) if needs_x else None,
        _param_grad(dgamma, state) if needs_w else None,
        _param_grad(dbeta, state, bias=True) if with_dbeta else None,
    )


def _param_grad(grad, state: NormState, *, bias: bool = False):
    """A parameter's gradient from the kernel's 1-D one, in the parameter's shape and dtype."""
    dtype = state.bias_dtype if bias else state.weight_dtype
    grad = grad.view(state.shape[len(state.shape) - state.weight_dims :])
    return grad if grad.dtype == dtype else grad.to(dtype)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, zero_centered_gamma):  # noqa: D102
        y, tensors, ctx.state = norm_forward(x, weight, bias, eps, zero_centered_gamma, rms=False)
        ctx.save_for_backward(*tensors)
        return y

    @staticmethod
    @once_differentiable
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
    @once_differentiable
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
    # The same kernels as with autograd, so that inference gives the training forward's bits.
    return norm_forward(x, weight, bias, eps, zero_centered_gamma, rms=False)[0]


def fused_rmsnorm(x, weight, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """RMSNorm over ``weight.dim()`` trailing dimensions (operands already checked)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps, zero_centered_gamma)
    return norm_forward(x, weight, None, eps, zero_centered_gamma, rms=True)[0]
