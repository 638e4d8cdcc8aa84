"""Backward fusion: an activation's backward and the preceding ``Bias``'s backward in one
place (``dx = act'(x) * dy`` and ``db = sum(dx)``, from one pass over the gradient)."""

from __future__ import annotations

from ..basic.activation import ActivationOperation
from ..basic.bias import Bias
from ..op import FusedOperation
from ._rewrite import op_at, replace_matching_runs

__all__ = ["BackwardActivationBias", "fuse_backward_activation_bias"]


class BackwardActivationBias(FusedOperation):
    """Backward of ``Bias`` followed (in forward order) by an activation, fused.

    Parameters
    ----------
    bias : Bias
    activation : ActivationOperation
    """

    def __init__(self, *, bias: Bias, activation: ActivationOperation) -> None:
        super().__init__([bias, activation])

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        bias_op, activation = self.basic_ops
        bias_ctx, activation_ctx = basic_op_ctxs
        grad_input, _ = activation.op_backward(activation_ctx, grad_output)
        grad_bias = bias_op.bias_grad(bias_ctx, grad_input)
        return grad_input, [[grad_bias], []], [(), ()]


def fuse_backward_activation_bias(ops, *, recipe=None):
    """Replace each ``Bias, activation`` run by a ``BackwardActivationBias``.

    Parameters
    ----------
    ops : list of FusibleOperation
    recipe : Recipe or None
        The autocast recipe (the fusion applies with and without FP8).
    """
    return replace_matching_runs(ops, _match_backward_activation_bias)


def _match_backward_activation_bias(ops, i):
    op, activation = ops[i], op_at(ops, i + 1)
    if type(op) is Bias and isinstance(activation, ActivationOperation) and activation.fusible:
        return BackwardActivationBias(bias=op, activation=activation), 2
    return None
