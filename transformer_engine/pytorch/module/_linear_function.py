"""The linear modules' autograd node: the functional linear core
(:mod:`transformer_engine.pytorch.functional.linear`) wrapped in one ``torch.autograd.Function``.

This is where the module side adds what the core leaves to its callers: which gradients are
needed (read from the tensors' ``requires_grad``), saving through autograd, the gradient's device
current during backward, and, for the autocast region's first FP8 module, the backward scale
update once its backward is done.

Under sequence parallelism a column-parallel GEMM's input arrives split along dimension 0: the
node all-gathers it before the GEMM, reduce-scatters the input gradient, and, when the weight
gradient reads the input in high precision, saves only the local shard and gathers it again in
backward. In FP8 with a per-tensor FP8 input quantizer the gather moves FP8 bytes
(``sequence_parallel_gemm_input``) and the gathered input is saved as its transposed FP8 copy.
"""

from __future__ import annotations

import torch

from .._tensor_parallel import (
    gather_along_first_dim,
    reduce_scatter_along_first_dim,
    sequence_parallel_gemm_input,
)
from ..device import device_guard
from ..functional.linear import LinearConfig, linear_backward, linear_forward
from ..quantization import BackwardScaleUpdate

__all__ = ["linear"]


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, inp, bias, config, backward_update, sp_group):  # noqa: D102
        full = inp
        if sp_group is not None:
            full, leading = sequence_parallel_gemm_input(
                inp, sp_group, config, columnwise=weight.requires_grad
            )
        out, saved = linear_forward(
            weight,
            full,
            bias,
            config,
            needs_dgrad=inp.requires_grad,
            needs_wgrad=weight.requires_grad,
            bias_requires_grad=bias is not None and bias.requires_grad,
        )
        if sp_group is not None:
            out = out.reshape(*leading, out.shape[-1])
            if saved.x is full and not isinstance(full, torch.Tensor):  # gathered in FP8
                full.update_usage(rowwise_usage=False, columnwise_usage=True)
        # Keep the local shard instead of the gathered input when backward reads it as it is.
        ctx.regather = (
            sp_group is not None
            and type(saved.x) is torch.Tensor
            and full is not inp
            and saved.x.data_ptr() == full.data_ptr()
        )
        if ctx.regather:
            saved.x = inp.reshape(-1, inp.shape[-1])
        ctx.save_for_backward(*saved.pack())
        ctx.saved = saved
        ctx.backward_update = backward_update
        ctx.sp_group, ctx.inp_shape = sp_group, inp.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        with device_guard(grad_out.device):
            saved = ctx.saved
            saved.unpack(ctx.saved_tensors)
            if ctx.regather:
                saved.x = gather_along_first_dim(saved.x, ctx.sp_group)[0]
            dx, dw, dbias = linear_backward(saved, grad_out)
            if dx is not None and ctx.sp_group is not None:
                dx = reduce_scatter_along_first_dim(dx, ctx.sp_group)[0].view(ctx.inp_shape)
            if ctx.backward_update is not None:
                ctx.backward_update.complete()
        return dw, dx, dbias, None, None, None


def linear(
    weight: torch.Tensor,
    inp: torch.Tensor,
    bias: torch.Tensor | None,
    config: LinearConfig,
    backward_update: BackwardScaleUpdate | None = None,
    sequence_parallel_group=None,
) -> torch.Tensor:
    """``inp @ weight^T + bias`` through the linear core, differentiable in grad mode.

    ``backward_update``: the region's backward scale update, completed at the end of this GEMM's
    backward (given to the GEMM of the region's first FP8 module whose backward runs last).
    ``sequence_parallel_group``: ``inp`` is this rank's slice (along dimension 0) of the input,
    all-gathered over the group before the GEMM; the input gradient is reduce-scattered back.
    """
    if torch.is_grad_enabled():
        return _LinearFunction.apply(
            weight, inp, bias, config, backward_update, sequence_parallel_group
        )
    if sequence_parallel_group is None:
        out, _ = linear_forward(weight, inp, bias, config, needs_dgrad=False, needs_wgrad=False)
        return out
    full, leading = sequence_parallel_gemm_input(
        inp, sequence_parallel_group, config, columnwise=False
    )
    out, _ = linear_forward(weight, full, bias, config, needs_dgrad=False, needs_wgrad=False)
    return out.reshape(*leading, out.shape[-1])
