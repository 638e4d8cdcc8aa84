"""What the FP8 producer fusions share: the forward ones cover one operation whose output the
next ``BasicLinear`` takes in FP8, cast with that linear's input quantizer; all of them
(forward and backward) are registered under delayed or current scaling only.
"""

from __future__ import annotations

from ...functional.linear import check_fp8_gemm_shapes
from ...functional.produced_fp8 import can_produce, per_tensor_fp8_recipe
from ...quantization import FP8GlobalStateManager
from ..basic._common import activation_dtype
from ..basic.basic_linear import BasicLinear
from ..op import FusedOperation
from ._kwargs import refuse_kwargs
from ._rewrite import replace_matching_runs

__all__ = ["ForwardProducerFusion", "replace_under_per_tensor_fp8"]


def replace_under_per_tensor_fp8(ops, recipe, match) -> list:
    """``ops`` with every run ``match`` accepts replaced (see ``replace_matching_runs``) when
    ``recipe`` is delayed or current scaling; otherwise ``ops`` unchanged, as a new list."""
    if not per_tensor_fp8_recipe(recipe):
        return list(ops)
    return replace_matching_runs(ops, match)


class ForwardProducerFusion(FusedOperation):
    """Base of a forward fusion covering ``op`` whose output the ``linear`` right after it
    (alone or first in a fused linear) takes in FP8. The linear is read, not covered: it is
    kept in a tuple, so that it is no submodule of this operation. A subclass writes
    :meth:`produce_forward`."""

    def __init__(self, op, linear: BasicLinear) -> None:
        super().__init__([op])
        self._linear = (linear,)

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
        refuse_kwargs(type(self).__name__, basic_op_kwargs)
        (op,) = self.basic_ops
        (ctx,) = basic_op_ctxs
        (linear,) = self._linear
        return self.produce_forward(op, ctx, input_, linear, next_op_input_quantizer), [()]

    def produce_forward(self, op, ctx, input_, linear: BasicLinear, quantizer):
        """``op``'s output for ``linear``: FP8 from ``quantizer`` where the fusion runs, else
        what ``op`` alone returns (``ctx`` is ``op``'s context, filled as its forward fills it)."""
        raise NotImplementedError(f"{type(self).__name__} does not define produce_forward")

    @staticmethod
    def casts_for(linear: BasicLinear, quantizer, values) -> bool:
        """Whether the fusion runs: FP8 autocast on with a per-tensor recipe, ``quantizer``
        (the fuser's next-input quantizer) is ``linear``'s, and it can take a produced tensor
        of ``values``' dtype for a linear computing in the dtype it chooses for ``values``."""
        return (
            FP8GlobalStateManager.is_fp8_enabled()
            and per_tensor_fp8_recipe(FP8GlobalStateManager.get_fp8_recipe())
            and quantizer is linear.get_input_quantizer()
            and can_produce(quantizer, values.dtype, activation_dtype(values, linear.weight))
        )

    @staticmethod
    def check_linear_shapes(ctx, linear: BasicLinear) -> bool:
        """Run ``linear``'s FP8 GEMM shape checks before anything is written; returns whether
        the transposed copy (weight gradient) is needed."""
        check_fp8_gemm_shapes(linear.local_in_features, linear.local_out_features)
        # a sequence-parallel linear builds the transposed copy from the gathered bytes
        gathers = linear._parallelism.gathers_input
        return ctx.requires_grad and linear.weight.requires_grad and not gathers
