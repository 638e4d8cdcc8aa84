"""Forward fusion: ``BasicLinear`` + ``ConstantScale`` + in-place ``AddExtraInput``
(``extra += scale * x W^T``, e.g. a scaled residual branch)."""

from __future__ import annotations

from ..basic.basic_linear import EVERY_PLACEMENT, BasicLinear, fusible_linear
from ..basic.extra_io import AddExtraInput
from ..basic.simple import ConstantScale
from ..op import FusedOperation
from ._kwargs import refuse_kwargs
from ._rewrite import op_at, replace_matching_runs

__all__ = ["ForwardLinearScaleAdd", "fuse_forward_linear_scale_add"]


class ForwardLinearScaleAdd(FusedOperation):
    """Forward of ``BasicLinear``, ``ConstantScale`` and ``AddExtraInput(in_place=True)``:
    ``extra += scale * (x W^T)``, returned as the output.

    Parameters
    ----------
    linear : BasicLinear
    scale : ConstantScale
    add : AddExtraInput
        With ``in_place=True``.

    What it saves: the chain allocates the GEMM output and then a second buffer for the scaled
    product. Here the GEMM output (which nothing else holds) is scaled in place and added into
    the extra input's storage, so the forward allocates the GEMM output only.

    What it does not do, to keep the chain's bits: upstream passes the scale to the GEMM as
    ``alpha`` and accumulates into the extra input (``beta = 1``). That rounds
    ``scale * x W^T + extra`` once, where the chain rounds the product, the scaled product and
    the sum separately; in FP16/BF16 (and for scales that are not powers of two) the bits
    differ, so the three roundings stay.
    """

    def __init__(self, *, linear: BasicLinear, scale: ConstantScale, add: AddExtraInput) -> None:
        if not (isinstance(add, AddExtraInput) and add.in_place):
            raise ValueError(
                "ForwardLinearScaleAdd: add must be AddExtraInput(in_place=True), got "
                f"{add!r}; without in_place the chain allocates the sum anyway, so run the ops "
                "unfused"
            )
        super().__init__([linear, scale, add])

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
        refuse_kwargs("ForwardLinearScaleAdd", basic_op_kwargs)
        linear, scale, add = self.basic_ops
        out = linear.linear_forward(basic_op_ctxs[0], input_)
        # the GEMM output is ours alone: ConstantScale's multiplication, in place (same kernel
        # and bits as ``out * scale``)
        out = out.mul_(scale.scale)
        out, _ = add.fuser_forward(
            basic_op_ctxs[2:],
            out,
            basic_op_extra_inputs=basic_op_extra_inputs[2:],
            prev_op_grad_output_quantizer=None,
            next_op_input_quantizer=next_op_input_quantizer,
            basic_op_kwargs=basic_op_kwargs[2:],
        )
        return out, [(), (), ()]


def fuse_forward_linear_scale_add(ops, *, recipe=None):
    """Replace each ``BasicLinear, ConstantScale, AddExtraInput(in_place=True)`` run by a
    :class:`ForwardLinearScaleAdd` (with and without FP8).

    Parameters
    ----------
    ops : list of FusibleOperation
    recipe : Recipe or None
    """
    return replace_matching_runs(ops, _match_forward_linear_scale_add)


def _match_forward_linear_scale_add(ops, i):
    linear, scale, add = ops[i], op_at(ops, i + 1), op_at(ops, i + 2)
    if (
        fusible_linear(linear, EVERY_PLACEMENT)
        and type(scale) is ConstantScale
        and type(add) is AddExtraInput
        and add.in_place
    ):
        return ForwardLinearScaleAdd(linear=linear, scale=scale, add=add), 3
    return None
