"""Backward fusion: an activation's backward that writes the previous ``BasicLinear``'s FP8
output gradient itself (and the bias gradient of a ``Bias`` between them).

Under delayed or current scaling the activation's backward kernel reads the incoming gradient
and the saved activation input once and writes, in the same pass, the derivative in FP8 with
the linear's grad-output quantizer (in the layouts the linear's GEMMs read: row-wise for the
input gradient, transposed for the weight gradient) and its column sums (the bias gradient).
The linear's backward takes that FP8 gradient as it is. ``te.LayerNormMLP`` hands FC1 its
gradient the same way.
"""

from __future__ import annotations

from ...functional.produced_fp8 import activation_gradient_producer, can_produce, produce_fp8
from ..basic._common import plain
from ..basic.activation import ActivationOperation
from ..basic.basic_linear import BasicLinear, fusible_linear
from ..basic.bias import Bias
from ..op import FusedOperation
from ._producer import replace_under_per_tensor_fp8
from ._rewrite import op_at

__all__ = ["BackwardActivationCast", "fuse_backward_activation_cast"]


class BackwardActivationCast(FusedOperation):
    """Backward of ``BasicLinear``, an optional ``Bias`` and an activation (forward order).

    Parameters
    ----------
    linear : BasicLinear
    activation : ActivationOperation
    bias : Bias, optional
        Between them, of size ``linear.out_features``.

    What differs from the chain: the chain rounds the activation's gradient to its dtype
    (BF16, FP16) before the cast and sums the rounded values for the bias gradient; here the
    float32 derivative is cast and summed directly (one rounding, as ``te.LayerNormMLP`` and
    upstream do). With float32 activations the FP8 gradient is the chain's; the bias gradient
    is the same sum, in another order on CUDA (the kernel adds row tiles first). Where the
    linear's backward takes no FP8 gradient (high precision, ``backward_override``), its
    quantizer cannot take a produced tensor, or the dtypes differ, the operations run as the
    chain does.
    """

    def __init__(
        self, *, linear: BasicLinear, activation: ActivationOperation, bias: Bias | None = None
    ) -> None:
        ops = [linear, activation] if bias is None else [linear, bias, activation]
        super().__init__(ops)

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        linear, activation = self.basic_ops[0], self.basic_ops[-1]
        linear_ctx, activation_ctx = basic_op_ctxs[0], basic_op_ctxs[-1]
        layouts = linear.grad_output_layouts(linear_ctx) if linear_ctx.requires_grad else None
        if layouts is None:
            return super().fuser_backward(
                basic_op_ctxs, grad_output, basic_op_grad_extra_outputs=basic_op_grad_extra_outputs
            )
        h = activation.saved_input(activation_ctx)
        grad = plain(grad_output)
        config = linear.saved_state(linear_ctx).config
        quantizer = config.grad_output_quantizer
        if not can_produce(quantizer, h.dtype, config.activation_dtype):
            return super().fuser_backward(
                basic_op_ctxs, grad_output, basic_op_grad_extra_outputs=basic_op_grad_extra_outputs
            )
        grad = grad if grad.dtype == h.dtype else grad.to(h.dtype)
        spec = activation._spec()
        h2 = h.reshape(-1, h.shape[-1])
        # the width spelled out: -1 cannot be inferred when there are no rows (zero tokens)
        grad2 = grad.reshape(h2.shape[0], grad.shape[-1])
        bias_ctx = basic_op_ctxs[1] if len(self.basic_ops) == 3 else None
        with_dbias = bias_ctx is not None and bias_ctx.bias_requires_grad

        produce, amax_of = activation_gradient_producer(grad2, h2, spec, with_dbias)
        rowwise, columnwise = layouts
        dh, dbias = produce_fp8(
            quantizer, produce, amax_of, tuple(h2.shape), h2.dtype, h2.device,
            rowwise=rowwise, columnwise=columnwise,
        )  # fmt: skip
        grad_input, linear_grads = linear.op_backward(linear_ctx, dh)
        grad_params = [list(linear_grads), []]
        if bias_ctx is not None:
            grad_bias = dbias.to(bias_ctx.bias_dtype) if with_dbias else None
            grad_params.insert(1, [grad_bias])
        return grad_input, grad_params, [() for _ in self.basic_ops]


def fuse_backward_activation_cast(ops, *, recipe=None):
    """Replace each ``BasicLinear[, Bias], activation`` run by a
    :class:`BackwardActivationCast` (under delayed or current scaling only).

    Parameters
    ----------
    ops : list of FusibleOperation
    recipe : Recipe or None
    """
    return replace_under_per_tensor_fp8(ops, recipe, _match_backward_activation_cast)


def _match_backward_activation_cast(ops, i):
    linear = ops[i]
    # a column linear's output gradient is this rank's features, cast where it is (its amax
    # reduced over the group under current scaling)
    if not fusible_linear(linear, ("column", "column+sp")):
        return None
    bias, activation = op_at(ops, i + 1), op_at(ops, i + 2)
    if type(bias) is Bias and bias.folds_into(linear):
        if isinstance(activation, ActivationOperation) and activation.fusible:
            return BackwardActivationCast(linear=linear, bias=bias, activation=activation), 3
        return None
    if isinstance(bias, ActivationOperation) and bias.fusible:
        return BackwardActivationCast(linear=linear, activation=bias), 2
    return None
