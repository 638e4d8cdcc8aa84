"""Parameterless shape and scale operations: ``Identity``, ``Reshape``, ``ConstantScale`` and
``Dropout``."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..op import BasicOperation, OperationContext
from ._common import plain

__all__ = ["Identity", "Reshape", "ConstantScale", "Dropout"]


class Identity(BasicOperation):
    """Return the input unchanged (the gradient passes through)."""

    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        *,
        prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None,
    ) -> torch.Tensor:
        return input_

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        return grad_output, []


class Reshape(BasicOperation):
    """Reshape the input to ``shape`` (one entry may be ``-1``).

    Parameters
    ----------
    shape : iterable of int
    """

    def __init__(self, shape: Iterable[int]) -> None:
        super().__init__()
        self.shape = tuple(int(s) for s in shape)
        if sum(s == -1 for s in self.shape) > 1:
            raise ValueError(f"Reshape: shape={self.shape} has more than one -1")

    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        *,
        prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None,
    ) -> torch.Tensor:
        ctx.input_shape = input_.shape
        return plain(input_).reshape(self.shape)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        return plain(grad_output).reshape(ctx.input_shape), []


class ConstantScale(BasicOperation):
    """Multiply by a constant: ``y = scale * x``.

    Parameters
    ----------
    scale : float
    """

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = float(scale)

    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        *,
        prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None,
    ) -> torch.Tensor:
        return plain(input_) * self.scale

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        return plain(grad_output) * self.scale, []


class Dropout(BasicOperation):
    """Zero each element with probability ``p`` in training and scale the rest by
    ``1 / (1 - p)``; the identity in eval mode (``module.eval()``) or when ``p == 0``.

    Parameters
    ----------
    p : float
        In ``[0, 1)``.

    The mask is drawn from the generator of the input's device (``torch.manual_seed``).
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        p = float(p)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p={p!r} must be in [0, 1)")
        self.p = p

    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        *,
        prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None,
    ) -> torch.Tensor:
        x = plain(input_)
        if not self.training or self.p == 0.0:
            ctx.mask = None
            return x
        keep = torch.rand(x.shape, device=x.device) >= self.p
        mask = keep.to(x.dtype) * (1.0 / (1.0 - self.p))
        if ctx.requires_grad:
            ctx.save_for_backward(mask)
        ctx.mask = True
        return x * mask

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        grad_output = plain(grad_output)
        if ctx.mask is None:
            return grad_output, []
        (mask,) = ctx.saved_tensors
        return grad_output * mask, []
