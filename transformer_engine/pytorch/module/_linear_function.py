"""The linear modules' autograd node: the functional linear core
(:mod:`transformer_engine.pytorch.functional.linear`) wrapped in one ``torch.autograd.Function``.

This is where the module side adds what the core leaves to its callers: which gradients are
needed (read from the tensors' ``requires_grad``), saving through autograd, the gradient's device
current during backward, and, for the autocast region's first FP8 module, the backward scale
update once its backward is done.

Under sequence parallelism a column-parallel GEMM's input arrives split along dimension 0: the
node all-gathers it before the GEMM, reduce-scatters the input gradient, and keeps only the
local shard for backward, which gathers it again for the weight gradient (the backward's
collectives overlap its GEMMs: :mod:`.._parallel_backward`). In FP8 with a
per-tensor FP8 input quantizer the gather moves FP8 bytes (``sequence_parallel_gemm_input``)
and the shard kept is the local FP8 rows (``regather_fp8_shard`` in backward); otherwise the
high-precision shard is kept when the weight gradient reads the input as it is. A row-parallel
GEMM under sequence parallelism reduce-scatters its output along dimension 0 and all-gathers
the output gradient in backward, in FP8 under a per-tensor FP8 grad-output quantizer
(``sequence_parallel_grad_output``).
"""

from __future__ import annotations

import torch

from .._parallel_backward import column_parallel_backward
from .._sequence_parallel_input import keep_local_shard
from .._tensor_parallel import (
    reduce_scatter_along_first_dim,
    sequence_parallel_gemm_input,
    sequence_parallel_grad_output,
)
from ..device import device_guard
from ..functional._once_differentiable import once_differentiable
from ..functional.linear import LinearConfig, linear_backward, linear_forward
from ..quantization import BackwardScaleUpdate
from ._outputs import function_output

__all__ = ["linear"]


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: D102
        ctx, weight, inp, bias, config, backward_update, sp_group, out_sp_group, in_grad_group
    ):  # fmt: skip
        full, shard = inp, None
        if sp_group is not None:
            full, leading, shard = sequence_parallel_gemm_input(inp, sp_group, config)
        out, saved = linear_forward(
            weight,
            full,
            bias,
            config,
            needs_dgrad=inp.requires_grad,
            # With an FP8 shard the weight gradient reads the shard gathered again in backward:
            # the gathered input needs no transposed copy now.
            needs_wgrad=weight.requires_grad and shard is None,
            bias_requires_grad=bias is not None and bias.requires_grad,
        )
        ctx.kept_shard = None
        if sp_group is not None:
            out = out.reshape(*leading, out.shape[-1])
            ctx.kept_shard = keep_local_shard(saved, inp, full, shard, weight.requires_grad)
        if out_sp_group is not None:
            out = reduce_scatter_along_first_dim(out, out_sp_group)[0]
        ctx.save_for_backward(*saved.pack())
        ctx.saved = saved
        ctx.backward_update = backward_update
        ctx.sp_group, ctx.out_sp_group, ctx.inp_shape = sp_group, out_sp_group, inp.shape
        ctx.in_grad_group = in_grad_group
        return function_output(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        with device_guard(grad_out.device):
            saved = ctx.saved
            saved.unpack(ctx.saved_tensors)
            communication = column_parallel_backward(
                saved, ctx.kept_shard, ctx.sp_group, ctx.in_grad_group
            )
            if ctx.out_sp_group is not None:
                # The layouts the GEMMs read; it gathers in high precision unless they run
                # in per-tensor FP8 (no backward_override).
                grad_out = sequence_parallel_grad_output(
                    grad_out, ctx.out_sp_group, saved.config,
                    rowwise=saved.w is not None, columnwise=saved.x is not None,
                )  # fmt: skip
            dx, dw, dbias = linear_backward(saved, grad_out, communication=communication)
            if communication is not None:
                dx = communication.input_gradient(dx, ctx.inp_shape)
            if saved.config.wgrad_store is None:  # else backward_dw() still reads x
                saved.release_unpacked()
            if ctx.backward_update is not None:
                ctx.backward_update.complete()
        return dw, dx, dbias, None, None, None, None, None


def linear(
    weight: torch.Tensor,
    inp: torch.Tensor,
    bias: torch.Tensor | None,
    config: LinearConfig,
    backward_update: BackwardScaleUpdate | None = None,
    sequence_parallel_group=None,
    output_sequence_parallel_group=None,
    input_gradient_group=None,
) -> torch.Tensor:
    """``inp @ weight^T + bias`` through the linear core, differentiable in grad mode.

    ``backward_update``: the region's backward scale update, completed at the end of this GEMM's
    backward (given to the GEMM of the region's first FP8 module whose backward runs last).
    ``sequence_parallel_group`` (column-parallel): ``inp`` is this rank's slice (along
    dimension 0) of the input, all-gathered over the group before the GEMM; the input gradient
    is reduce-scattered back. ``output_sequence_parallel_group`` (row-parallel): the output is
    reduce-scattered (summed) over the group along dimension 0 and its gradient all-gathered;
    the bias, added after the reduction, is the caller's (``bias`` must be ``None``).
    ``input_gradient_group`` (column-parallel without sequence parallelism): the input gradient
    is all-reduced over the group. The backward overlaps its collectives with its GEMMs
    (:mod:`.._parallel_backward`).
    """
    if output_sequence_parallel_group is not None and bias is not None:
        raise ValueError(
            "linear: a bias with output_sequence_parallel_group would be summed over the ranks; "
            "pass bias=None and add it to the reduce-scattered output"
        )
    if torch.is_grad_enabled():
        return _LinearFunction.apply(
            weight, inp, bias, config, backward_update, sequence_parallel_group,
            output_sequence_parallel_group, input_gradient_group,
        )  # fmt: skip
    full, leading = inp, None
    if sequence_parallel_group is not None:
        full, leading, _ = sequence_parallel_gemm_input(inp, sequence_parallel_group, config)
    out, _ = linear_forward(weight, full, bias, config, needs_dgrad=False, needs_wgrad=False)
    if leading is not None:
        out = out.reshape(*leading, out.shape[-1])
    if output_sequence_parallel_group is not None:
        out = reduce_scatter_along_first_dim(out, output_sequence_parallel_group)[0]
    return function_output(out)
