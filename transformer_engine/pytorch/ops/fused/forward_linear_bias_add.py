"""Forward fusion: ``BasicLinear`` (+ ``Bias``) + in-place ``AddExtraInput`` (a residual
added into the caller's buffer)."""

from __future__ import annotations

from ..basic._common import autocast_dtype
from ..basic.basic_linear import EVERY_PLACEMENT, BasicLinear, fusible_linear
from ..basic.bias import Bias
from ..basic.extra_io import AddExtraInput
from ..op import FusedOperation
from ._kwargs import refuse_kwargs
from ._owned_buffers import add_into_fresh
from ._rewrite import op_at, replace_matching_runs

__all__ = ["ForwardLinearBiasAdd", "fuse_forward_linear_bias_add"]


class ForwardLinearBiasAdd(FusedOperation):
    """Forward of ``BasicLinear``, an optional ``Bias`` and ``AddExtraInput(in_place=True)``:
    ``extra += x W^T (+ b)``, returned as the output.

    Parameters
    ----------
    linear : BasicLinear
    bias : Bias or None
    add : AddExtraInput
        With ``in_place=True``.

    What it saves: the chain allocates the GEMM output, then a second buffer for the bias sum.
    Here the bias is added into the GEMM's own output (which nothing else holds), and that is
    added into the extra input's storage, so the whole forward allocates the GEMM output only.

    What it does not do, to keep the chain's bits: upstream accumulates the GEMM directly into
    the extra input (GEMM ``beta = 1``) with the bias in the GEMM epilogue. That rounds the sum
    ``x W^T + b + extra`` once, where the chain rounds the product, the bias sum and the
    residual sum separately (different bits in FP16/BF16, and a different reduction kernel
    even in FP32), so the three steps stay separate roundings here.
    """

    def __init__(self, *, linear: BasicLinear, bias: Bias | None, add: AddExtraInput) -> None:
        if not (isinstance(add, AddExtraInput) and add.in_place):
            raise ValueError(
                "ForwardLinearBiasAdd: add must be AddExtraInput(in_place=True), got "
                f"{add!r}; without in_place the chain allocates the sum anyway, so run the ops "
                "unfused"
            )
        super().__init__([linear, add] if bias is None else [linear, bias, add])
        self._has_bias = bias is not None

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
        refuse_kwargs("ForwardLinearBiasAdd", basic_op_kwargs)
        linear, add = self.basic_ops[0], self.basic_ops[-1]
        out = linear.linear_forward(basic_op_ctxs[0], input_)
        if self._has_bias:
            bias_op = self.basic_ops[1]
            bias_op.check_width(out.shape[-1])
            # the Bias op's arithmetic (operands in the autocast dtype, else the input's),
            # written into the GEMM output when its dtype already is that one
            dtype = autocast_dtype(out) or out.dtype
            bias = bias_op.bias_forward(basic_op_ctxs[1]).to(dtype)
            out = add_into_fresh(out.to(dtype), bias)
        out, _ = add.fuser_forward(
            basic_op_ctxs[-1:],
            out,
            basic_op_extra_inputs=basic_op_extra_inputs[-1:],
            prev_op_grad_output_quantizer=None,
            next_op_input_quantizer=next_op_input_quantizer,
            basic_op_kwargs=basic_op_kwargs[-1:],
        )
        return out, [() for _ in self.basic_ops]


def _in_place_add(op) -> bool:
    return type(op) is AddExtraInput and op.in_place


def fuse_forward_linear_bias_add(ops, *, recipe=None):
    """Replace each ``BasicLinear[, Bias], AddExtraInput(in_place=True)`` run by a
    :class:`ForwardLinearBiasAdd` (with and without FP8).

    Parameters
    ----------
    ops : list of FusibleOperation
    recipe : Recipe or None
    """
    return replace_matching_runs(ops, _match_forward_linear_bias_add)


def _match_forward_linear_bias_add(ops, i):
    op = ops[i]
    if not fusible_linear(op, EVERY_PLACEMENT):
        return None
    nxt, after = op_at(ops, i + 1), op_at(ops, i + 2)
    # the bias is added after the linear's forward (a row linear's output already reduced)
    if type(nxt) is Bias and nxt.local_size == op.local_out_features and _in_place_add(after):
        return ForwardLinearBiasAdd(linear=op, bias=nxt, add=after), 3
    if _in_place_add(nxt):
        return ForwardLinearBiasAdd(linear=op, bias=None, add=nxt), 2
    return None
