"""Forward fusion: ``BasicLinear`` + ``Bias`` (+ an activation) in one place.

The bias is added in the GEMM's epilogue (FP8: inside the scaled GEMM before the single
rounding to the output dtype; high precision: ``addmm``), and the activation is applied to the
GEMM's output right away. Each covered operation's context is filled exactly as its own
forward would fill it, so any backward (fused or not) works on it.
"""

from __future__ import annotations

from ..basic.activation import ActivationOperation
from ..basic.basic_linear import BasicLinear, fusible_linear
from ..basic.bias import Bias
from ..op import FusedOperation
from ._kwargs import refuse_kwargs
from ._rewrite import op_at, replace_matching_runs

__all__ = ["ForwardLinearBiasActivation", "fuse_forward_linear_bias_activation"]


class ForwardLinearBiasActivation(FusedOperation):
    """Forward of ``BasicLinear``, ``Bias`` and optionally an activation, fused.

    Parameters
    ----------
    linear : BasicLinear
    bias : Bias
        Of size ``linear.out_features``.
    activation : ActivationOperation, optional
    """

    def __init__(self, *, linear: BasicLinear, bias: Bias, activation=None) -> None:
        ops = [linear, bias] if activation is None else [linear, bias, activation]
        super().__init__(ops)

    def fuser_forward(
        self,
        basic_op_ctxs,
        input_,
        *,
        basic_op_extra_inputs,
        prev_op_grad_output_quantizer,
        next_op_input_quantizer,
        basic_op_kwargs,
    ):
        refuse_kwargs("ForwardLinearBiasActivation", basic_op_kwargs)
        linear, bias_op = self.basic_ops[0], self.basic_ops[1]
        bias = bias_op.bias_forward(basic_op_ctxs[1])
        output = linear.linear_forward(basic_op_ctxs[0], input_, bias=bias)
        if len(self.basic_ops) == 3:
            output = self.basic_ops[2].activation_forward(basic_op_ctxs[2], output)
        return output, [() for _ in self.basic_ops]


def fuse_forward_linear_bias_activation(ops, *, recipe=None):
    """Replace each ``BasicLinear, Bias[, activation]`` run by a ``ForwardLinearBiasActivation``.

    Parameters
    ----------
    ops : list of FusibleOperation
    recipe : Recipe or None
        The autocast recipe (the fusion applies with and without FP8).
    """
    return replace_matching_runs(ops, _match_forward_linear_bias_activation)


def _match_forward_linear_bias_activation(ops, i):
    op, bias = ops[i], op_at(ops, i + 1)
    # column parallelism: the split bias joins this rank's output features
    linear_ok = fusible_linear(op, ("column", "column+sp"))
    if not (linear_ok and type(bias) is Bias and bias.folds_into(op)):
        return None
    activation = op_at(ops, i + 2)
    if not (isinstance(activation, ActivationOperation) and activation.fusible):
        activation = None
    fused = ForwardLinearBiasActivation(linear=op, bias=bias, activation=activation)
    return fused, 2 if activation is None else 3
