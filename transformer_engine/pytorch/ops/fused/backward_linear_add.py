"""Backward fusion: in-place ``MakeExtraOutput`` followed (in forward order) by
``BasicLinear``: the linear's input gradient and the branch's gradient summed without a new
buffer."""

from __future__ import annotations

from ..basic._common import plain
from ..basic.basic_linear import EVERY_PLACEMENT, BasicLinear, fusible_linear
from ..basic.extra_io import MakeExtraOutput, _writable_like
from ..op import FusedOperation
from ._owned_buffers import add_into_fresh
from ._rewrite import op_at, replace_matching_runs

__all__ = ["BackwardLinearAdd", "fuse_backward_linear_add"]


class BackwardLinearAdd(FusedOperation):
    """Backward of ``MakeExtraOutput(in_place=True)`` and the ``BasicLinear`` after it:
    ``dx = dy W + d(extra)``.

    Parameters
    ----------
    backward_add : MakeExtraOutput
        With ``in_place=True``.
    linear : BasicLinear

    What it saves: the sum never gets a buffer of its own. It goes into the extra output's
    gradient when that may be written (as ``MakeExtraOutput(in_place=True)`` does), and
    otherwise (a broadcast gradient, another dtype) into the dgrad GEMM's output, which the
    chain would have allocated a third buffer beside.

    What it does not do, to keep the chain's bits: upstream runs the dgrad GEMM with
    ``beta = 1`` into the extra output's gradient, rounding ``dy W + d(extra)`` once; the
    chain rounds the GEMM output and the sum separately (different bits in FP16/BF16, and a
    different GEMM kernel even in FP32), so the two roundings stay.
    """

    def __init__(self, *, backward_add: MakeExtraOutput, linear: BasicLinear) -> None:
        if not (isinstance(backward_add, MakeExtraOutput) and backward_add.in_place):
            raise ValueError(
                "BackwardLinearAdd: backward_add must be MakeExtraOutput(in_place=True), got "
                f"{backward_add!r}"
            )
        super().__init__([backward_add, linear])

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        _, linear = self.basic_ops
        add_ctx, linear_ctx = basic_op_ctxs
        grad_input, linear_grads = linear.op_backward(linear_ctx, grad_output)
        if not add_ctx.requires_grad:
            # the fuser would stop after the linear: nothing before it needs a gradient
            return grad_input, [[], linear_grads], [(), ()]
        (grad_extra,) = basic_op_grad_extra_outputs[0]
        grad_input = plain(grad_input)
        if grad_extra is not None:
            grad_extra = plain(grad_extra)
            if _writable_like(grad_extra, grad_input):
                grad_input = grad_extra.add_(grad_input)
            else:
                # the dgrad output is ours alone (fresh from the GEMM)
                grad_input = add_into_fresh(grad_input, grad_extra, not_aliasing=(grad_output,))
        return grad_input, [[], linear_grads], [(), ()]


def fuse_backward_linear_add(ops, *, recipe=None):
    """Replace each ``MakeExtraOutput(in_place=True), BasicLinear`` run by a
    :class:`BackwardLinearAdd` (with and without FP8).

    Parameters
    ----------
    ops : list of FusibleOperation
    recipe : Recipe or None
    """
    return replace_matching_runs(ops, _match_backward_linear_add)


def _match_backward_linear_add(ops, i):
    op, linear = ops[i], op_at(ops, i + 1)
    if type(op) is MakeExtraOutput and op.in_place and fusible_linear(linear, EVERY_PLACEMENT):
        return BackwardLinearAdd(backward_add=op, linear=linear), 2
    return None
