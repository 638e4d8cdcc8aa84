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
(``sequence_parallel_grad_output``). With a module's ``ub_*`` flags (``overlap``) those gathers
and reduce-scatters run chunk by chunk with the GEMMs instead (:mod:`.._ring_gemm`).
"""

from __future__ import annotations

import torch

from .._parallel_backward import column_parallel_backward
from .._ring_gemm import (
    column_forward_input,
    keep_column_input,
    row_backward_grad_output,
    row_forward_gemm,
    row_forward_output,
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
        ctx, weight, inp, bias, config, backward_update, sp_group, out_sp_group, in_grad_group,
        overlap,
    ):  # fmt: skip
        out, saved, kept = _forward(
            weight, inp, bias, config, sp_group, out_sp_group, overlap,
            needs_dgrad=inp.requires_grad, needs_wgrad=weight.requires_grad,
        )  # fmt: skip
        ctx.kept_shard = kept
        ctx.save_for_backward(*saved.pack())
        ctx.saved = saved
        ctx.backward_update = backward_update
        ctx.sp_group, ctx.out_sp_group, ctx.inp_shape = sp_group, out_sp_group, inp.shape
        ctx.in_grad_group, ctx.overlap = in_grad_group, overlap
        return function_output(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        with device_guard(grad_out.device):
            saved = ctx.saved
            saved.unpack(ctx.saved_tensors)
            overlap = ctx.overlap
            communication = column_parallel_backward(
                saved, ctx.kept_shard, ctx.sp_group, ctx.in_grad_group,
                pipelined_dgrad=overlap is not None and overlap.rs_dgrad,
            )  # fmt: skip
            if ctx.out_sp_group is not None:
                # Gathered (in FP8 where the GEMMs read per-tensor FP8) now, or by chunks with
                # the input gradient's GEMM (ub_overlap_ag).
                grad_out, communication = row_backward_grad_output(
                    grad_out, ctx.out_sp_group, saved, overlap
                )
            dx, dw, dbias = linear_backward(saved, grad_out, communication=communication)
            if communication is not None:
                dx = communication.input_gradient(dx, ctx.inp_shape)
            if saved.config.wgrad_store is None:  # else backward_dw() still reads x
                saved.release_unpacked()
            if ctx.backward_update is not None:
                ctx.backward_update.complete()
        return dw, dx, dbias, None, None, None, None, None, None


def _forward(weight, inp, bias, config, sp_group, out_sp_group, overlap, *, needs_dgrad,
             needs_wgrad):  # fmt: skip
    """The core's forward with the collectives of sequence parallelism: ``(out, saved,
    kept)``, ``kept`` what the backward gathers again."""
    full, shard, forward_gemm, ring_rows, kept = inp, None, None, None, None
    if sp_group is not None:
        full, leading, shard, forward_gemm, ring_rows = column_forward_input(
            inp, sp_group, config, overlap
        )
    elif out_sp_group is not None:
        forward_gemm = row_forward_gemm(inp, out_sp_group, overlap)
    out, saved = linear_forward(
        weight, full, bias, config, needs_dgrad=needs_dgrad,
        # With an FP8 shard the weight gradient reads the shard gathered again in backward:
        # the gathered input needs no transposed copy now.
        needs_wgrad=needs_wgrad and shard is None,
        bias_requires_grad=bias is not None and bias.requires_grad,
        forward_gemm=forward_gemm,
    )  # fmt: skip
    if sp_group is not None:
        out = out.reshape(*leading, out.shape[-1])
        if needs_dgrad or needs_wgrad:
            kept = keep_column_input(saved, inp, full, shard, needs_wgrad, ring_rows)
    if out_sp_group is not None:
        out = row_forward_output(out, inp.shape[:-1], out_sp_group, forward_gemm)
    return out, saved, kept


def linear(
    weight: torch.Tensor,
    inp: torch.Tensor,
    bias: torch.Tensor | None,
    config: LinearConfig,
    backward_update: BackwardScaleUpdate | None = None,
    sequence_parallel_group=None,
    output_sequence_parallel_group=None,
    input_gradient_group=None,
    overlap=None,
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
    (:mod:`.._parallel_backward`). ``overlap`` (``_userbuffers.CommOverlapFlags``): which
    collectives under sequence parallelism run chunk by chunk with their GEMM
    (:mod:`.._ring_gemm`).
    """
    if output_sequence_parallel_group is not None and bias is not None:
        raise ValueError(
            "linear: a bias with output_sequence_parallel_group would be summed over the ranks; "
            "pass bias=None and add it to the reduce-scattered output"
        )
    if torch.is_grad_enabled():
        return _LinearFunction.apply(
            weight, inp, bias, config, backward_update, sequence_parallel_group,
            output_sequence_parallel_group, input_gradient_group, overlap,
        )  # fmt: skip
    out = _forward(
        weight, inp, bias, config, sequence_parallel_group, output_sequence_parallel_group,
        overlap, needs_dgrad=False, needs_wgrad=False,
    )[0]  # fmt: skip
    return function_output(out)
