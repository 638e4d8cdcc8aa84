"""Forward fusion: an activation that writes the next ``BasicLinear``'s FP8 input itself.

Under delayed or current scaling the activation kernel reads its input once and writes the
linear's FP8 operand (and the transposed copy the weight gradient reads) in its own pass, with
the linear's input quantizer: delayed scaling with its scale and amax buffer, current scaling
after an amax-only pass of the activation for the scale. The activation's output never exists
in high precision, and the linear does not cast it again. ``te.LayerNormMLP`` feeds FC2 the
same way.
"""

from __future__ import annotations

from ...functional.produced_fp8 import activation_producer, produce_fp8
from ..basic._common import plain
from ..basic.activation import ActivationOperation
from ..basic.basic_linear import BasicLinear, fusible_linear
from ._producer import ForwardProducerFusion, replace_under_per_tensor_fp8
from ._rewrite import op_at

__all__ = ["ForwardActivationCast", "fuse_forward_activation_cast"]


class ForwardActivationCast(ForwardProducerFusion):
    """Forward of an activation whose output goes straight into a ``BasicLinear`` in FP8.

    Parameters
    ----------
    activation : ActivationOperation
        The operation this fused operation covers.
    linear : BasicLinear
        The operation right after it (the next entry of the plan: alone, or the first
        operation of a fused linear such as ``ForwardLinearBiasActivation``); read, not
        covered: its input quantizer is the cast's, its weight decides whether the transposed
        copy is written.

    The activation's context is filled as its own forward fills it (its input, kept for the
    backward), so any backward runs on it.

    What differs from the chain: the chain rounds the activation to its dtype (BF16, FP16)
    and casts those values; here the float32 values are cast directly (one rounding, as
    ``te.LayerNormMLP`` and upstream do), so in BF16/FP16 the FP8 bytes, the amax and what
    follows can differ in the last bit of the activation. With float32 activations the bits
    are the chain's. Where the linear's input quantizer cannot take a produced tensor, or
    the activation's dtype differs from the linear's compute dtype, or FP8 is off, it runs
    the activation alone, as the chain does.
    """

    def __init__(self, *, activation: ActivationOperation, linear: BasicLinear) -> None:
        if not isinstance(activation, ActivationOperation) or type(linear) is not BasicLinear:
            raise TypeError(
                "ForwardActivationCast: needs an ActivationOperation and a BasicLinear, got "
                f"{type(activation).__name__} and {type(linear).__name__}"
            )
        super().__init__(activation, linear)

    def produce_forward(self, activation, ctx, input_, linear, quantizer):
        x = plain(input_)
        if not self.casts_for(linear, quantizer, x):
            return activation.activation_forward(ctx, x)
        spec = activation._spec()
        cols = x.shape[-1] // 2 if spec.gated else x.shape[-1]
        if (spec.gated and x.shape[-1] % 2) or cols != linear.local_in_features:
            # the chain's errors: the activation's (odd gated width) or the linear's
            return activation.activation_forward(ctx, x)
        # the linear's checks before anything is written (no amax recorded for a refused call)
        needs_wgrad = self.check_linear_shapes(ctx, linear)
        shape = (*x.shape[:-1], cols)

        # the kernels take the rows as a 2-D tensor (as LayerNormMLP's FC1 output)
        x2 = x.reshape(-1, x.shape[-1])

        produce, amax_of = activation_producer(x2, spec)
        out, _ = produce_fp8(
            quantizer, produce, amax_of, (x2.shape[0], cols), x.dtype, x.device,
            rowwise=True, columnwise=needs_wgrad,
        )  # fmt: skip
        if len(shape) != 2:
            out = out.view(shape)  # the activation's output shape, which its gradient takes
        activation.save_input(ctx, x)
        return out


def fuse_forward_activation_cast(ops, *, recipe=None):
    """Replace each activation directly followed by a ``BasicLinear`` by a
    :class:`ForwardActivationCast` (under delayed or current scaling only; the linear stays
    in the list for the fusions that follow).

    Parameters
    ----------
    ops : list of FusibleOperation
    recipe : Recipe or None
    """
    return replace_under_per_tensor_fp8(ops, recipe, _match_forward_activation_cast)


def _match_forward_activation_cast(ops, i):
    op, linear = ops[i], op_at(ops, i + 1)
    # before a sequence-parallel column linear the FP8 bytes are all-gathered as they are
    allow = ("column", "column+sp", "row", "row+sp")
    if isinstance(op, ActivationOperation) and op.fusible and fusible_linear(linear, allow):
        return ForwardActivationCast(activation=op, linear=linear), 1
    return None
