"""Backward fusion: ``BasicLinear`` followed (in forward order) by ``ConstantScale``."""

from __future__ import annotations

from ..basic.basic_linear import EVERY_PLACEMENT, BasicLinear, fusible_linear
from ..basic.simple import ConstantScale
from ..op import FusedOperation
from ._rewrite import op_at, replace_matching_runs

__all__ = ["BackwardLinearScale", "fuse_backward_linear_scale"]


class BackwardLinearScale(FusedOperation):
    """Backward of ``BasicLinear`` and the ``ConstantScale`` after it:
    ``dx = (scale * dy) W`` and ``dW = (scale * dy)^T x``.

    Parameters
    ----------
    linear : BasicLinear
    scale : ConstantScale

    What it saves: nothing over the chain; it runs the same two steps (one pass scaling the
    gradient, then the linear's backward) as one entry of the fuser's plan.

    What it does not do, to keep the chain's bits: upstream passes the scale to the dgrad and
    wgrad GEMMs as ``alpha`` instead of scaling the gradient first. The GEMM then rounds
    ``scale * (dy W)`` where the chain multiplies ``scale * dy`` rounded; in FP8 the gradient
    quantizer would also see ``dy`` instead of ``scale * dy``, giving another amax, another
    scale and other FP8 values. So the gradient is scaled first, as in the chain.
    """

    def __init__(self, *, linear: BasicLinear, scale: ConstantScale) -> None:
        super().__init__([linear, scale])

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        linear, scale = self.basic_ops
        linear_ctx, scale_ctx = basic_op_ctxs
        grad_scaled, _ = scale.op_backward(scale_ctx, grad_output)
        if not linear_ctx.requires_grad:
            # the fuser would stop after the scale: nothing before it needs a gradient
            return grad_scaled, [[], []], [(), ()]
        grad_input, linear_grads = linear.op_backward(linear_ctx, grad_scaled)
        return grad_input, [linear_grads, []], [(), ()]


def fuse_backward_linear_scale(ops, *, recipe=None):
    """Replace each ``BasicLinear, ConstantScale`` run by a :class:`BackwardLinearScale`
    (with and without FP8).

    Parameters
    ----------
    ops : list of FusibleOperation
    recipe : Recipe or None
    """
    return replace_matching_runs(ops, _match_backward_linear_scale)


def _match_backward_linear_scale(ops, i):
    op, scale = ops[i], op_at(ops, i + 1)
    if fusible_linear(op, EVERY_PLACEMENT) and type(scale) is ConstantScale:
        return BackwardLinearScale(linear=op, scale=scale), 2
    return None
