"""Operations with extra tensor channels: ``AddExtraInput`` (a residual added in) and
``MakeExtraOutput`` (a branch taken out)."""

from __future__ import annotations

from ..op import BasicOperation
from ._common import plain

__all__ = ["AddExtraInput", "MakeExtraOutput"]


def _check_in_place(owner: str, in_place: bool) -> None:
    if in_place:
        raise NotImplementedError(
            f"{owner}: in_place=True is not implemented yet; use in_place=False"
        )


class AddExtraInput(BasicOperation):
    """``y = x + extra``, with ``extra`` an extra input of the fuser (or ``Sequential``).

    Parameters
    ----------
    in_place : bool, default False
        Upstream adds into the extra input's storage; only ``False`` is implemented.
    """

    num_extra_inputs = 1

    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        _check_in_place("AddExtraInput", in_place)
        self.in_place = False

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
        basic_op_ctxs[0].extra_dtype = extra.dtype
        return x + extra, [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        grad_output = plain(grad_output)
        grad_extra = grad_output.to(basic_op_ctxs[0].extra_dtype)
        return grad_output, [[]], [(grad_extra,)]


class MakeExtraOutput(BasicOperation):
    """Return the input both as the main output and as an extra output of the fuser; in the
    backward the two gradients are added.

    Parameters
    ----------
    in_place : bool, default False
        Upstream accumulates into the extra output's gradient storage; only ``False`` is
        implemented.
    """

    num_extra_outputs = 1

    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        _check_in_place("MakeExtraOutput", in_place)
        self.in_place = False

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
        if grad_extra is not None:
            grad_input = grad_input + plain(grad_extra)
        return grad_input, [[]], [()]
