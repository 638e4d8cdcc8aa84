"""Backward fusion: ``MakeExtraOutput`` (not in place) followed (in forward order) by
``RMSNorm``: the pre-norm residual pattern ``h -> (RMSNorm(h), h)``."""

from __future__ import annotations

from ..basic._common import plain
from ..basic.extra_io import MakeExtraOutput
from ..basic.normalization import RMSNorm
from ..op import FusedOperation
from ._owned_buffers import add_into_fresh
from ._rewrite import op_at, replace_matching_runs

__all__ = ["BackwardAddRMSNorm", "fuse_backward_add_rmsnorm"]


class BackwardAddRMSNorm(FusedOperation):
    """Backward of ``MakeExtraOutput(in_place=False)`` and the ``RMSNorm`` after it:
    ``dx = RMSNorm'(x)^T dy + d(extra)``.

    Parameters
    ----------
    add : MakeExtraOutput
        With ``in_place=False``.
    rmsnorm : RMSNorm

    What it saves: the sum is written into the norm's input gradient, a buffer the norm's
    backward has just made and nothing else holds, instead of a new one (the chain allocates
    it beside the norm's gradient); the extra output's gradient is only read.

    What it does not do, to keep the chain's bits: upstream's kernel adds the residual's
    gradient inside the norm's backward, before the input gradient is rounded to its dtype;
    the chain rounds the norm's gradient first and then the sum (different bits in
    FP16/BF16), so the add stays a separate rounding.
    """

    def __init__(self, *, add: MakeExtraOutput, rmsnorm: RMSNorm) -> None:
        if not isinstance(add, MakeExtraOutput) or add.in_place:
            raise ValueError(
                f"BackwardAddRMSNorm: add must be MakeExtraOutput(in_place=False), got {add!r}"
            )
        super().__init__([add, rmsnorm])

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        _, rmsnorm = self.basic_ops
        add_ctx, norm_ctx = basic_op_ctxs
        grad_input, norm_grads = rmsnorm.op_backward(norm_ctx, grad_output)
        if not add_ctx.requires_grad:
            # the fuser would stop after the norm: nothing before it needs a gradient
            return grad_input, [[], norm_grads], [(), ()]
        (grad_extra,) = basic_op_grad_extra_outputs[0]
        grad_input = plain(grad_input)
        if grad_extra is not None:
            # the norm's gradient comes from a local autograd call on detached leaves: ours
            grad_input = add_into_fresh(grad_input, plain(grad_extra), not_aliasing=(grad_output,))
        return grad_input, [[], norm_grads], [(), ()]


def fuse_backward_add_rmsnorm(ops, *, recipe=None):
    """Replace each ``MakeExtraOutput(in_place=False), RMSNorm`` run by a
    :class:`BackwardAddRMSNorm` (with and without FP8).

    Parameters
    ----------
    ops : list of FusibleOperation
    recipe : Recipe or None
    """
    return replace_matching_runs(ops, _match_backward_add_rmsnorm)


def _match_backward_add_rmsnorm(ops, i):
    op, norm = ops[i], op_at(ops, i + 1)
    if type(op) is MakeExtraOutput and not op.in_place and type(norm) is RMSNorm:
        return BackwardAddRMSNorm(add=op, rmsnorm=norm), 2
    return None
