"""``LayerNormMLP``'s FC1 -> activation -> FC2 as one autograd node.

One node instead of three lets the activation hand FP8 straight to its neighbours' GEMMs:

* forward: the activation kernel writes FC2's FP8 input (and the transposed copy FC2's weight
  gradient reads) in its own pass, with FC2's input scale and amax
  (``quantize_produced``; current scaling first runs an amax-only pass of the activation for
  the scale), instead of writing the activation in high precision for FC2 to read and cast
  again;
* backward: the activation's gradient is written in FP8 with FC1's grad-output scale, both
  layouts, together with FC1's bias gradient, in one pass over FC2's input gradient and FC1's
  saved output.

What is kept for backward: FC1's saved operands (the norm output, FP8 transposed under FP8),
FC1's output ``h`` in the activation dtype (the activation's backward reads it), and FC2's
(the activation output, FP8 transposed under FP8). Other quantizers (custom recipes) get the
activation in the activation dtype and the linear core casts it as usual.

Under sequence parallelism (``sp_group``) FC1's input arrives split along dimension 0: the node
all-gathers it (``sequence_parallel_gemm_input``: FP8 bytes under a per-tensor FP8 recipe),
keeps only the local shard (FP8, or the input itself in high precision), which backward gathers
again for FC1's weight gradient, and reduce-scatters its gradient. With ``out_sp_group`` (FC2
row-parallel under sequence parallelism) the node reduce-scatters FC2's output along dimension
0 and all-gathers the output gradient (``sequence_parallel_grad_output``: FP8 bytes cast with
FC2's grad-output quantizer under a per-tensor FP8 recipe). With the module's ``ub_*`` flags
(``overlap``) those collectives run chunk by chunk with FC1's and FC2's GEMMs instead
(:mod:`.._ring_gemm`).
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
from ..functional.activation import (
    ActivationSpec,
    activation_backward,
    activation_forward,
)
from ..functional.linear import LinearConfig, linear_backward, linear_forward
from ..functional.produced_fp8 import (
    activation_gradient_producer,
    activation_producer,
    produce_fp8,
)
from ..quantization import BackwardScaleUpdate
from ._outputs import function_output

__all__ = ["fc1_activation_fc2"]


def _fusable(config: LinearConfig, quantizer) -> bool:
    """Whether a producer can write this GEMM operand in FP8 itself (the per-tensor FP8
    quantizers: delayed scaling directly, current scaling after the producer's amax pass)."""
    return (
        config.fp8
        and config.backward_override is None
        and getattr(quantizer, "quantize_produced", None) is not None
    )


def _fc2_input(h2, spec, fc2_config, fc2_weight, *, columnwise: bool):
    """The activation of FC1's output ``h2`` as FC2 takes it: FP8 written by the activation
    kernel when FC2's input quantizer allows, else in ``h2``'s dtype."""
    quantizer = fc2_config.input_quantizer
    if not _fusable(fc2_config, quantizer):
        return activation_forward(h2, spec)

    produce, amax_of = activation_producer(h2, spec)
    shape = (h2.shape[0], fc2_weight.shape[-1])
    act, _ = produce_fp8(
        quantizer, produce, amax_of, shape, h2.dtype, h2.device,
        rowwise=True, columnwise=columnwise,
    )  # fmt: skip
    return act


class _MLPBody(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: D102
        ctx, ln_out, fc1_weight, fc1_bias, fc2_weight, fc2_bias, spec, fc1_config, fc2_config,
        backward_update, sp_group, out_sp_group, in_grad_group, overlap,
    ):  # fmt: skip
        fc1_bias_grad = fc1_bias is not None and fc1_bias.requires_grad
        fc2_bias_grad = fc2_bias is not None and fc2_bias.requires_grad
        fc1_needed = ln_out.requires_grad or fc1_weight.requires_grad or fc1_bias_grad
        # 2-D operands throughout: FC1's output is then the GEMM's own tensor (not a view),
        # which backward can release as soon as the activation's gradient is computed.
        local = ln2 = ln_out.reshape(-1, ln_out.shape[-1])
        leading, shard, gather_gemm, ring_rows = ln_out.shape[:-1], None, None, None
        if sp_group is not None:
            ln2, _, shard, gather_gemm, ring_rows = column_forward_input(
                local, sp_group, fc1_config, overlap
            )
            leading = (-1, *ln_out.shape[1:-1])
        h2, saved1 = linear_forward(
            fc1_weight, ln2, fc1_bias, fc1_config,
            needs_dgrad=ln_out.requires_grad,
            # An FP8 shard is gathered again in backward for the weight gradient.
            needs_wgrad=fc1_weight.requires_grad and shard is None,
            bias_requires_grad=fc1_bias_grad, forward_gemm=gather_gemm,
        )  # fmt: skip
        ctx.kept_shard = None
        if sp_group is not None:
            ctx.kept_shard = keep_column_input(
                saved1, local, ln2, shard, fc1_weight.requires_grad, ring_rows
            )
        act = _fc2_input(h2, spec, fc2_config, fc2_weight, columnwise=fc2_weight.requires_grad)
        scatter_gemm = None
        if out_sp_group is not None:
            scatter_gemm = row_forward_gemm(act, out_sp_group, overlap)
        out, saved2 = linear_forward(
            fc2_weight, act, fc2_bias, fc2_config,
            needs_dgrad=fc1_needed, needs_wgrad=fc2_weight.requires_grad,
            bias_requires_grad=fc2_bias_grad, forward_gemm=scatter_gemm,
        )  # fmt: skip
        if fc2_weight.requires_grad and not isinstance(act, torch.Tensor):
            # FC2's weight gradient reads only the transposed copy.
            act.update_usage(rowwise_usage=False, columnwise_usage=True)
        tensors1, tensors2 = saved1.pack(), saved2.pack()
        ctx.save_for_backward(*tensors1, *tensors2, h2 if fc1_needed else None)
        ctx.split = len(tensors1)
        # The activation output's tensors among FC2's (the weight may follow them).
        ctx.act_tensors = saved2.input_tensor_count(tensors2)
        ctx.saved = (saved1, saved2)
        ctx.spec, ctx.fc1_needed, ctx.fc1_bias_grad = spec, fc1_needed, fc1_bias_grad
        ctx.ln_shape, ctx.sp_group, ctx.out_sp_group = ln_out.shape, sp_group, out_sp_group
        ctx.in_grad_group, ctx.overlap = in_grad_group, overlap
        ctx.backward_update = backward_update
        ctx.released = False
        return function_output(_output(out, leading, out_sp_group, scatter_gemm))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        if ctx.released:
            raise RuntimeError(
                "LayerNormMLP: a second backward through the same forward (retain_graph=True) is "
                "not supported: the first one freed FC1's output and the activation it saved, "
                "to save memory; run the forward again for each backward"
            )
        with device_guard(grad_out.device):
            saved1, saved2 = ctx.saved
            tensors = ctx.saved_tensors
            saved1.unpack(tensors[: ctx.split])
            saved2.unpack(tensors[ctx.split : -1])
            h2 = tensors[-1]
            overlap, fc2_communication = ctx.overlap, None
            if ctx.out_sp_group is not None:
                # Gathered (in FP8 where the GEMMs read per-tensor FP8) now, or by chunks with
                # FC2's input-gradient GEMM (ub_overlap_ag).
                grad_out, fc2_communication = row_backward_grad_output(
                    grad_out, ctx.out_sp_group, saved2, overlap
                )
            d_act, dw2, db2 = linear_backward(saved2, grad_out, None, fc2_communication)
            if fc2_communication is not None and d_act is not None:
                d_act = d_act.reshape(-1, d_act.shape[-1])
            ctx.released = True  # from here on saved tensors are freed (checked above)
            saved2.w = None  # FC2's FP8 weight copy (a cached one lives on in its workspace)
            # Saved tensors live until this node's backward returns; the ones this node made
            # and no longer needs give their memory back now (FC1's GEMMs run next).
            if saved2.config.wgrad_store is None:  # else backward_dw() still reads them
                saved2.release_unpacked()  # the storage's views would keep the bytes
                _release(tensors[ctx.split : ctx.split + ctx.act_tensors])
            d_ln = dw1 = db1 = None
            if ctx.fc1_needed:
                dh, dbias = _activation_gradient(ctx, saved1, d_act, h2)
                del d_act
                _release((h2,))
                # FC1's input gathered again and its gradient reduced, overlapped with FC1's
                # GEMMs
                communication = column_parallel_backward(
                    saved1, ctx.kept_shard, ctx.sp_group, ctx.in_grad_group,
                    pipelined_dgrad=overlap is not None and overlap.rs_dgrad,
                )  # fmt: skip
                d_ln, dw1, db1 = linear_backward(saved1, dh, dbias, communication)
                if communication is not None:
                    d_ln = communication.input_gradient(d_ln, ctx.ln_shape)
                elif d_ln is not None:
                    d_ln = d_ln.reshape(ctx.ln_shape)
            if saved1.config.wgrad_store is None:  # else backward_dw() still reads x
                saved1.release_unpacked()
            if ctx.backward_update is not None:
                ctx.backward_update.complete()
        return d_ln, dw1, db1, dw2, db2, None, None, None, None, None, None, None, None


def _output(out, leading, out_sp_group, scatter_gemm):
    """FC2's output in the input's leading dimensions; under sequence parallelism this rank's
    rows of the sum over the group (reduce-scattered here unless FC2's GEMM did it)."""
    if out_sp_group is None:
        return out.reshape(*leading, out.shape[-1])
    return row_forward_output(out, leading, out_sp_group, scatter_gemm)


def _release(tensors) -> None:
    """Free the memory of saved tensors this node created (their storage goes, the tensor
    objects the autograd graph holds become empty)."""
    for t in tensors:
        if t is not None:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def _activation_gradient(ctx, saved1, d_act, h2):
    """``(dh, dbias)``: the activation's gradient as FC1's backward takes it; in FP8 (delayed
    scaling) produced in FP8 with FC1's grad-output quantizer, with FC1's bias gradient."""
    spec: ActivationSpec = ctx.spec
    config = saved1.config
    quantizer = config.grad_output_quantizer
    if d_act.dtype != h2.dtype:
        d_act = d_act.to(h2.dtype)
    gemms_read_grad = saved1.w is not None or saved1.x is not None
    if gemms_read_grad and not saved1.high_precision_backward and _fusable(config, quantizer):
        produce, amax_of = activation_gradient_producer(d_act, h2, spec, ctx.fc1_bias_grad)
        return produce_fp8(
            quantizer, produce, amax_of, tuple(h2.shape), h2.dtype, h2.device,
            rowwise=saved1.w is not None, columnwise=saved1.x is not None,
        )  # fmt: skip
    return activation_backward(d_act.contiguous(), h2, spec), None


def fc1_activation_fc2(
    ln_out: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    spec: ActivationSpec,
    fc1_config: LinearConfig,
    fc2_config: LinearConfig,
    backward_update: BackwardScaleUpdate | None = None,
    sp_group=None,
    out_sp_group=None,
    in_grad_group=None,
    overlap=None,
) -> torch.Tensor:
    """``fc2(act(fc1(ln_out)))``, differentiable in grad mode (one autograd node).

    ``backward_update``: the region's backward scale update, completed at the end of this
    node's backward (after FC1's GEMMs, the last of the module).
    ``sp_group``: ``ln_out`` is this rank's slice along dimension 0 (sequence parallelism),
    all-gathered before FC1; its gradient is reduce-scattered back.
    ``out_sp_group``: FC2's output is reduce-scattered (summed) along dimension 0 over the group
    and its gradient all-gathered (FC2 row-parallel; ``fc2_bias`` must then be ``None``).
    ``in_grad_group``: ``ln_out``'s gradient is all-reduced over the group (FC1
    column-parallel without sequence parallelism). FC1's backward overlaps its collectives with
    its GEMMs (:mod:`.._parallel_backward`). ``overlap`` (``_userbuffers.CommOverlapFlags``):
    which collectives under sequence parallelism run chunk by chunk with their GEMM (FC1's
    gather and its input gradient's reduce-scatter, FC2's reduce-scatter and its output
    gradient's gather: :mod:`.._ring_gemm`).
    """
    if out_sp_group is not None and fc2_bias is not None:
        raise ValueError(
            "fc1_activation_fc2: an FC2 bias with out_sp_group would be summed over the ranks; "
            "pass fc2_bias=None and add it to the reduce-scattered output"
        )
    if torch.is_grad_enabled():
        return _MLPBody.apply(
            ln_out, fc1_weight, fc1_bias, fc2_weight, fc2_bias, spec, fc1_config, fc2_config,
            backward_update, sp_group, out_sp_group, in_grad_group, overlap,
        )  # fmt: skip
    ln2, leading = ln_out.reshape(-1, ln_out.shape[-1]), ln_out.shape[:-1]
    gather_gemm = scatter_gemm = None
    if sp_group is not None:
        ln2, _, _, gather_gemm, _ = column_forward_input(ln2, sp_group, fc1_config, overlap)
        leading = (-1, *ln_out.shape[1:-1])
    h2, _ = linear_forward(fc1_weight, ln2, fc1_bias, fc1_config, needs_dgrad=False,
                           needs_wgrad=False, forward_gemm=gather_gemm)  # fmt: skip
    act = _fc2_input(h2, spec, fc2_config, fc2_weight, columnwise=False)
    if out_sp_group is not None:
        scatter_gemm = row_forward_gemm(act, out_sp_group, overlap)
    out, _ = linear_forward(fc2_weight, act, fc2_bias, fc2_config, needs_dgrad=False,
                            needs_wgrad=False, forward_gemm=scatter_gemm)  # fmt: skip
    return function_output(_output(out, leading, out_sp_group, scatter_gemm))
