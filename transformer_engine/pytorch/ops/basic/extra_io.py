"""Operations with extra tensor channels: ``AddExtraInput`` (a residual added in) and
``MakeExtraOutput`` (a branch taken out).

Both take ``in_place``, upstream's opt-in to reuse memory that the caller hands over:

* ``AddExtraInput(in_place=True)`` adds the input *into the extra input's storage* and returns
  that storage as the output. The extra input's values are overwritten (its version counter
  moves, so autograd refuses a backward that still needs the old values), and the output has
  the extra input's dtype and shape.
* ``MakeExtraOutput(in_place=True)`` adds the main gradient *into the extra output's
  gradient* in the backward and passes that buffer on as the input gradient, saving one
  allocation. Where that buffer cannot be written safely (missing, broadcast, another dtype or
  shape) the sum is made out of place; the values are the same either way.
"""

from __future__ import annotations

import torch

from ..op import BasicOperation
from ._common import plain

__all__ = ["AddExtraInput", "MakeExtraOutput"]


def _check_flag(owner: str, in_place) -> bool:
    if not isinstance(in_place, bool):
        raise TypeError(f"{owner}: in_place must be a bool, got {in_place!r}")
    return in_place


class AddExtraInput(BasicOperation):
    """``y = x + extra``, with ``extra`` an extra input of the fuser (or ``Sequential``).

    Parameters
    ----------
    in_place : bool, default False
        Add ``x`` into ``extra``'s storage and return it (no new output buffer). ``extra``
        must then already have the output's shape; its old values are lost, and ``y`` has its
        dtype.
    """

    num_extra_inputs = 1

    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = _check_flag("AddExtraInput", in_place)

    def op_forward(self, *args, **kwargs):
        raise RuntimeError("AddExtraInput runs through fuser_forward (it has an extra input)")

    def op_backward(self, *args, **kwargs):
        raise RuntimeError("AddExtraInput runs through fuser_backward (it has an extra input)")

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
        (extra,) = basic_op_extra_inputs[0]
        x, extra = plain(input_), plain(extra)
        if extra.device != x.device:
            raise ValueError(
                f"AddExtraInput: the extra input is on {extra.device} but the input is on "
                f"{x.device}; move it to {x.device}"
            )
        ctx = basic_op_ctxs[0]
        ctx.input_dtype, ctx.extra_dtype = x.dtype, extra.dtype
        ctx.input_shape, ctx.extra_shape = x.shape, extra.shape
        try:
            out_shape = torch.broadcast_shapes(x.shape, extra.shape)
        except RuntimeError:
            # torch's own message ("The size of tensor a (4) must match ...") names neither
            # the operation nor which tensor is which
            raise ValueError(
                f"AddExtraInput: the extra input has shape {tuple(extra.shape)}, which does not "
                f"broadcast with the input's shape {tuple(x.shape)}; pass an extra input of "
                "the input's shape (or one that broadcasts to it)"
            ) from None
        if not self.in_place:
            return x + extra, [()]
        if out_shape != extra.shape:
            raise ValueError(
                f"AddExtraInput(in_place=True): the extra input has shape {tuple(extra.shape)} "
                f"but the sum has shape {tuple(out_shape)}; the sum is written into the extra "
                "input, so pass one of the sum's shape (or use in_place=False)"
            )
        # detach(): a new tensor object on the same storage, so autograd gives the output its
        # own history instead of rewriting the caller's tensor's
        out = extra.detach()
        out += x
        return out, [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        grad_output = plain(grad_output)
        grad_input = _reduce_to(grad_output, ctx.input_shape).to(ctx.input_dtype)
        grad_extra = _reduce_to(grad_output, ctx.extra_shape).to(ctx.extra_dtype)
        return grad_input, [[]], [(grad_extra,)]


def _reduce_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The gradient of a tensor of ``shape`` that was broadcast to ``grad``'s shape."""
    if grad.shape == shape:
        return grad
    lead = grad.dim() - len(shape)
    dims = list(range(lead))
    dims += [lead + i for i, size in enumerate(shape) if size == 1 and grad.shape[lead + i] != 1]
    reduced = grad.sum(dim=dims, keepdim=True) if dims else grad
    return reduced.reshape(shape)


class MakeExtraOutput(BasicOperation):
    """Return the input both as the main output and as an extra output of the fuser; in the
    backward the two gradients are added.

    Parameters
    ----------
    in_place : bool, default False
        Accumulate the main gradient into the extra output's gradient buffer and pass that
        buffer on as the input gradient (one allocation fewer). Only for callers that do not
        read the extra output's gradient after this backward.
    """

    num_extra_outputs = 1

    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = _check_flag("MakeExtraOutput", in_place)

    def op_forward(self, *args, **kwargs):
        raise RuntimeError("MakeExtraOutput runs through fuser_forward (it has an extra output)")

    def op_backward(self, *args, **kwargs):
        raise RuntimeError("MakeExtraOutput runs through fuser_backward (it has an extra output)")

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
        x = plain(input_)
        # a separate tensor: autograd must see two outputs, not one object twice
        return x, [(x.clone(),)]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        (grad_extra,) = basic_op_grad_extra_outputs[0]
        grad_input = plain(grad_output)
        if grad_extra is None:
            return grad_input, [[]], [()]
        grad_extra = plain(grad_extra)
        if self.in_place and _writable_like(grad_extra, grad_input):
            grad_extra += grad_input
            return grad_extra, [[]], [()]
        return grad_input + grad_extra, [[]], [()]


def _writable_like(buffer: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether ``buffer += other`` keeps ``buffer``'s meaning: same shape and dtype, and one
    memory location per element (autograd hands out broadcast, zero-stride gradients, e.g. the
    gradient of a ``sum``)."""
    return (
        buffer.shape == other.shape
        and buffer.dtype == other.dtype
        and buffer.is_contiguous()
        and not buffer.requires_grad
    )
