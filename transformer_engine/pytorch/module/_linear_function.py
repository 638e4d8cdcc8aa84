"""The linear modules' autograd node: the functional linear core
(:mod:`transformer_engine.pytorch.functional.linear`) wrapped in one ``torch.autograd.Function``.

This is where the module side adds what the core leaves to its callers: which gradients are
needed (read from the tensors' ``requires_grad``), saving through autograd, the gradient's device
current during backward, and, for the autocast region's first FP8 module, the backward scale
update once its backward is done.
"""

from __future__ import annotations

import torch

from ..device import device_guard
from ..functional.linear import LinearConfig, linear_backward, linear_forward
from ..quantization import BackwardScaleUpdate

__all__ = ["linear"]


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, inp, bias, config, backward_update):  # noqa: D102
        out, saved = linear_forward(
            weight,
            inp,
            bias,
            config,
            needs_dgrad=inp.requires_grad,
            needs_wgrad=weight.requires_grad,
            bias_requires_grad=bias is not None and bias.requires_grad,
        )
        ctx.save_for_backward(*saved.pack())
        ctx.saved = saved
        ctx.backward_update = backward_update
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        with device_guard(grad_out.device):
            saved = ctx.saved
            saved.unpack(ctx.saved_tensors)
            dx, dw, dbias = linear_backward(saved, grad_out)
            if ctx.backward_update is not None:
                ctx.backward_update.complete()
        return dw, dx, dbias, None, None


def linear(
    weight: torch.Tensor,
    inp: torch.Tensor,
    bias: torch.Tensor | None,
    config: LinearConfig,
    backward_update: BackwardScaleUpdate | None = None,
) -> torch.Tensor:
    """``inp @ weight^T + bias`` through the linear core, differentiable in grad mode.

    ``backward_update``: the region's backward scale update, completed at the end of this GEMM's
    backward (given to the GEMM of the region's first FP8 module whose backward runs last).
    """
    if torch.is_grad_enabled():
        return _LinearFunction.apply(weight, inp, bias, config, backward_update)
    out, _ = linear_forward(weight, inp, bias, config, needs_dgrad=False, needs_wgrad=False)
    return out
