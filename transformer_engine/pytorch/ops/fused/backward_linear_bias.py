"""Backward fusion: ``BasicLinear`` and the ``Bias`` after it, the bias gradient taken from the
pass that casts the output gradient to FP8, as ``te.Linear`` takes it."""

from __future__ import annotations

from ..basic.basic_linear import BasicLinear, fusible_linear
from ..basic.bias import Bias
from ..op import FusedOperation
from ._producer import replace_under_per_tensor_fp8
from ._rewrite import op_at

__all__ = ["BackwardLinearBias", "fuse_backward_linear_bias"]


class BackwardLinearBias(FusedOperation):
    """Backward of ``BasicLinear`` and the ``Bias`` after it (forward order), fused.

    Parameters
    ----------
    linear : BasicLinear
    bias : Bias
        Of size ``linear.out_features``.

    The chain sums the output gradient for the bias gradient in a pass of its own, after the
    linear's backward has read the same gradient to cast it to FP8. Here, where that cast also
    writes the transposed copy (the weight gradient reads it), the cast kernel adds the column
    sums in the same pass (``nvte_quantize_dbias``): one read of the gradient fewer a step.
    Elsewhere (no weight gradient) the bias gradient is the chain's sum. What differs from the
    chain: the sum is the cast kernel's, float32 added in row tiles first on CUDA and rounded
    once to the gradient's dtype, so on CUDA the bias gradient may differ from a plain sum's in
    the last place (float32 too: the additions run in another order), as ``te.Linear``'s does;
    it sums the gradient in the linear's compute dtype.
    """

    def __init__(self, *, linear: BasicLinear, bias: Bias) -> None:
        super().__init__([linear, bias])

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        linear = self.basic_ops[0]
        linear_ctx, bias_ctx = basic_op_ctxs
        if not linear_ctx.requires_grad:
            return super().fuser_backward(
                basic_op_ctxs, grad_output, basic_op_grad_extra_outputs=basic_op_grad_extra_outputs
            )
        grad_input, linear_grads, grad_bias = linear.backward_with_bias(
            linear_ctx, grad_output, bias_ctx
        )
        return grad_input, [list(linear_grads), [grad_bias]], [(), ()]


def fuse_backward_linear_bias(ops, *, recipe=None):
    """Replace each ``BasicLinear, Bias`` run by a :class:`BackwardLinearBias` (under delayed
    or current scaling only: the recipes whose grad-output cast computes the column sums).

    Parameters
    ----------
    ops : list of FusibleOperation
    recipe : Recipe or None
    """
    return replace_under_per_tensor_fp8(ops, recipe, _match_backward_linear_bias)


def _match_backward_linear_bias(ops, i):
    linear, bias = ops[i], op_at(ops, i + 1)
    # column parallelism: the bias is split like the output gradient it sums
    if (
        fusible_linear(linear, ("column", "column+sp"))
        and type(bias) is Bias
        and bias.folds_into(linear)
    ):
        return BackwardLinearBias(linear=linear, bias=bias), 2
    return None
