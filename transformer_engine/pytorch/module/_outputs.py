"""What modules return: outputs that are never views, and biases that outlive FSDP2's reshard.

A linear layer computes on 2-D operands and hands back ``out.reshape(*leading, features)``, a
view of the GEMM's tensor. Autograd refuses in-place ops (``y += residual``, ``y.mul_(s)``) on
a view that a custom ``autograd.Function`` returned, because replaying the view would bypass
the function's backward; and FSDP2 warns that an in-place op on a wrapped module's view output
drops its pre-backward hook. Returning a tensor that merely shares the storage (not a view of
it) costs nothing and avoids both.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["function_output", "reshape_output", "returned_bias"]


def function_output(out):
    """What an ``autograd.Function.forward`` returns for ``out``: ``out`` itself, or, for a
    view, the same storage as a tensor of its own (forward runs without grad: ``detach``
    makes no view)."""
    if type(out) is torch.Tensor and out._is_view():
        return out.detach()
    return out


class _ReshapeOutput(torch.autograd.Function):
    """``out.reshape(shape)`` returned as a tensor of its own; the gradient is reshaped back."""

    @staticmethod
    def forward(ctx, out, shape):  # noqa: D102
        ctx.shape = out.shape
        return function_output(out.reshape(shape))

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return grad.reshape(ctx.shape), None


def reshape_output(out: torch.Tensor, shape) -> torch.Tensor:
    """``out.reshape(shape)`` for a module to return: not a view, differentiable."""
    if type(out) is not torch.Tensor:
        return out.view(shape)  # a quantized output (fp8_output): its own view op
    if torch.is_grad_enabled() and out.requires_grad:
        return _ReshapeOutput.apply(out, tuple(shape))
    return function_output(out.reshape(shape))


def returned_bias(module, bias: torch.Tensor | None, dtype: torch.dtype | None = None):
    """The bias a module built with ``return_bias=True`` hands back (in ``dtype``) for the
    caller's later add. Where the module is an FSDP2 unit of its own (``fully_shard`` on it),
    a copy: FSDP2 frees the module's unsharded parameters as soon as its forward returns, and
    the parameter itself would reach the caller's add with no storage (also a bias a wrapped
    submodule returned). The copy is differentiable, so the gradient still reaches the
    parameter."""
    if bias is None:
        return None
    out = bias if dtype is None else bias.to(dtype)
    if isinstance(out, torch.nn.Parameter) and _is_fsdp2_unit(module):
        out = out.clone()
    return out


def _is_fsdp2_unit(module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no module is an FSDP2 unit
    unit = getattr(fsdp, "FSDPModule", None)
    return unit is not None and isinstance(module, unit)
