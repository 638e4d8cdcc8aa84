"""``Quantize``: cast the tensor (forward) and/or its gradient (backward) to FP8 inside
``te.autocast``."""

from __future__ import annotations

import torch

from ...quantization import FP8GlobalStateManager
from ..op import BasicOperation, OperationContext

__all__ = ["Quantize"]


class Quantize(BasicOperation):
    """Quantize the activation and/or its gradient with this operation's own quantizers.

    Parameters
    ----------
    forward : bool, default True
        Inside ``te.autocast``, return the input as an FP8 ``Float8Tensor`` (with both row-wise
        and column-wise data, ready for a following linear operation).
    backward : bool, default False
        Inside ``te.autocast``, return the gradient as an FP8 ``Float8Tensor`` (unless the
        recipe sets ``backward_override``: its backward stays in high precision).

    Outside ``te.autocast`` this is the identity. The quantizers follow the autocast recipe;
    delayed-scaling state lives on the input's device.
    """

    def __init__(self, forward: bool = True, backward: bool = False) -> None:
        super().__init__()
        self._quantize_forward = bool(forward)
        self._quantize_backward = bool(backward)

    def num_quantizers(self, mode: str) -> int:
        if mode == "forward":
            return int(self._quantize_forward)
        return int(self._quantize_backward)

    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        *,
        prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None,
    ) -> torch.Tensor:
        fp8 = FP8GlobalStateManager.is_fp8_enabled()
        # the gradient quantizer is taken now: the state may change before the backward runs;
        # a recipe with a backward_override keeps the whole backward in high precision
        quantize_grad = fp8 and self._quantize_backward
        if quantize_grad:
            recipe = FP8GlobalStateManager.get_fp8_recipe()
            quantize_grad = getattr(recipe, "backward_override", None) is None
        ctx.grad_quantizer = self.get_quantizer("backward", 0) if quantize_grad else None
        if not (fp8 and self._quantize_forward):
            return input_
        quantizer = self.get_quantizer("forward", 0)
        quantizer.set_usage(rowwise=True, columnwise=True)
        return quantizer.quantize_impl(input_)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        quantizer = ctx.grad_quantizer
        if quantizer is None:
            return grad_output, []
        quantizer.set_usage(rowwise=True, columnwise=True)
        return quantizer.quantize_impl(grad_output), []
