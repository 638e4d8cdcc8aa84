"""Tensor (and sequence) parallelism of ``BasicLinear`` and ``Bias``: the local sizes, and the
collectives around the linear core, as the ``te.Linear`` module places them.

* ``"column"``: the weight holds ``out_features / tp`` rows (the output's features are split);
  the input is whole and the input gradient is all-reduced; with ``sequence_parallel`` the input
  arrives split along dimension 0 and is all-gathered before the GEMM (in FP8 under a
  per-tensor FP8 recipe), only the local shard is kept for the weight gradient (gathered again
  in backward), and the input gradient is reduce-scattered back.
* ``"row"``: the weight holds ``in_features / tp`` columns (the input's features are split); the
  output is all-reduced, or reduce-scattered along dimension 0 with ``sequence_parallel``, whose
  output gradient is all-gathered in backward (in FP8 where the grad-output quantizer allows).
  A bias must be added after the reduction (``te.ops.Linear`` puts its ``Bias`` there).

The gradients follow Megatron-LM's convention (each collective's backward is the adjoint of its
forward when the computation downstream of a row-parallel output is replicated on every rank),
so a whole model's gradients equal the single-process model's, shards gathered and the partial
sums of sequence-parallel parameters all-reduced by the framework.

FP8: under current scaling an operand split along its features (the row-parallel input, the
column-parallel output gradient) has its amax reduced over the group, so every rank casts with
the whole tensor's scale; under delayed scaling, sequence parallelism needs the amaxes reduced
over a group containing the tensor-parallel one (``check_sequence_parallel_scaling``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..._parallel_backward import ColumnParallelBackward
from ..._ring_gemm import (
    column_forward_input,
    keep_column_input,
    row_backward_grad_output,
    row_forward_gemm,
    row_forward_output,
)
from ..._sequence_parallel_input import check_sequence_parallel_scaling, reduce_amaxes_over
from ..._tensor_parallel import allreduce, divide, set_tensor_model_parallel_attributes
from ..._userbuffers import CommOverlapFlags, check_comm_overlap_ready

__all__ = ["LinearParallelism", "tensor_parallel_size"]

_MODES = (None, "column", "row")


def tensor_parallel_size(owner: str, group) -> int:
    """The number of ranks in ``group`` (``None``: the default group), which needs
    ``torch.distributed`` initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{owner}: tensor parallelism needs torch.distributed; call "
            "torch.distributed.init_process_group(...) before building the operation (or leave "
            "the tensor-parallel arguments at their defaults in a single process)"
        )
    return dist.get_world_size(group)


class LinearParallelism:
    """How one ``BasicLinear`` is split over its tensor-parallel group, and the collectives
    that split implies. ``active`` is false without a mode or with a group of one rank: then
    every method is the identity and the local sizes are the whole ones."""

    def __init__(
        self, owner: str, in_features: int, out_features: int, mode, group, sequence_parallel,
        userbuffers_options=None,
    ) -> None:  # fmt: skip
        if mode not in _MODES:
            raise ValueError(
                f"{owner}: tensor_parallel_mode={mode!r} must be None, 'column' or 'row'"
            )
        self.owner = owner
        self.mode = mode
        self.group = group
        self.size = 1 if mode is None else tensor_parallel_size(owner, group)
        self.active = self.size > 1
        # as the modules: sequence parallelism takes effect only with a split over ranks
        self.sequence_parallel = self.active and bool(sequence_parallel)
        if self.active and mode == "column":
            out_features = divide(out_features, self.size, f"{owner}: out_features")
        elif self.active and mode == "row":
            in_features = divide(in_features, self.size, f"{owner}: in_features")
        self.local_in_features, self.local_out_features = in_features, out_features
        self.overlap = self._comm_overlap(userbuffers_options)

    def _comm_overlap(self, options) -> CommOverlapFlags | None:
        """``userbuffers_options`` (``{"comm_name": "qkv"}``): under sequence parallelism a
        column GEMM's gather and its input gradient's reduce-scatter, a row GEMM's
        reduce-scatter and its output gradient's gather run chunk by chunk with the GEMMs
        (``_ring_gemm``), as the module flags do."""
        if options is None:
            return None
        name = options.get("comm_name") if isinstance(options, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"{self.owner}: userbuffers_options={options!r} must be a dict with "
                "'comm_name', the layer's name in initialize_ub's configuration ('qkv', 'proj', "
                "'fc1' or 'fc2')"
            )
        if not self.sequence_parallel:
            return None
        column = self.mode == "column"
        return CommOverlapFlags(name, ag_fprop=column, rs_fprop=not column, rs_dgrad=column,
                                ag_dgrad=not column)  # fmt: skip

    @property
    def placement(self) -> str | None:
        """``None`` without a split, else ``"column"``, ``"column+sp"``, ``"row"`` or ``"row+sp"``:
        what a fusion must know to keep the collectives in place (``fusible_linear``)."""
        if not self.active:
            return None
        return self.mode + ("+sp" if self.sequence_parallel else "")

    # -- parameters and FP8 --------------------------------------------------------------------
    def mark_weight(self, weight: torch.Tensor) -> None:
        """Megatron-LM's partition attributes on the weight (column: dimension 0, row: 1), which
        gradient clipping and checkpoint tools read; nothing when the weight is whole."""
        if self.active and not hasattr(weight, "partition_dim"):
            set_tensor_model_parallel_attributes(weight, True, 0 if self.mode == "column" else 1, 1)

    def reduce_split_amaxes(self, input_quantizer, grad_output_quantizer) -> None:
        """When the quantizers are made: the operand split along its features (the row input,
        the column output gradient) has its amax reduced over the group (current scaling), so
        every rank casts with the whole tensor's scale; also where a fused producer (an
        activation writing the linear's FP8 input or gradient) casts it."""
        if not self.active:
            return
        split = [input_quantizer if self.mode == "row" else grad_output_quantizer]
        if self.gathers_input:
            # a producer writing the input before the gather casts with the whole tensor's scale
            split.append(input_quantizer)
        reduce_amaxes_over(split, self.group)

    def check_fp8(self, config, recipe) -> None:
        """Before an FP8 GEMM under sequence parallelism: the delayed-scaling rule."""
        if self.sequence_parallel and config.fp8:
            check_sequence_parallel_scaling(self.owner, recipe, self.group)

    # -- forward -------------------------------------------------------------------------------
    @property
    def gathers_input(self) -> bool:
        return self.sequence_parallel and self.mode == "column"

    def gemm_input(self, input_, config, shape):
        """``(gemm_input, leading, shard, forward_gemm, ring_rows)``: the input the GEMM reads
        (all-gathered along dimension 0 when the op gathers its input, else ``input_`` with
        ``leading=None``), the gathered leading shape (from ``shape``, the input's as the caller
        sees it: a fused producer's FP8 input arrives flattened to 2-D), the FP8 shard, and
        with ``userbuffers_options`` the core's ``forward_gemm`` that pipelines the gather or
        the row output's reduce-scatter (``_ring_gemm``; ``ring_rows``: the gathered rows when
        the input is gathered that way, which then stays this rank's rows)."""
        if self.overlap is not None:
            check_comm_overlap_ready(self.owner, self.overlap, self.size)
        if not self.gathers_input:
            forward_gemm = None
            if self.active and self.mode == "row" and self.sequence_parallel:
                forward_gemm = row_forward_gemm(input_, self.group, self.overlap)
            return input_, None, None, forward_gemm, None
        full, _, shard, forward_gemm, rows = column_forward_input(
            input_, self.group, config, self.overlap
        )
        leading = (shape[0] * self.size, *shape[1:-1]) if len(shape) else ()
        return full, leading, shard, forward_gemm, rows

    def finish_forward(self, ctx, saved, input_, shape, gathered, needs_wgrad, out):
        """After the core's forward (``gathered``: what :meth:`gemm_input` returned; ``shape``
        as there): the output in the gathered leading shape, the saved input reduced to this
        rank's shard (``ctx.kept_shard``), and a row-parallel output reduced over the group."""
        full, leading, shard, forward_gemm, ring_rows = gathered
        ctx.kept_shard = None
        if leading is not None:
            out = out.reshape(*leading, out.shape[-1])
            ctx.kept_shard = keep_column_input(saved, input_, full, shard, needs_wgrad, ring_rows)
            ctx.local_input_shape = shape
        if self.active and self.mode == "row":
            if self.sequence_parallel:
                return row_forward_output(out, shape[:-1], self.group, forward_gemm)
            return allreduce(out, self.group)[0]  # the GEMM's own output, summed in place
        return out

    # -- backward ------------------------------------------------------------------------------
    def backward_inputs(self, ctx, saved, grad_output):
        """Before the core's backward: ``(grad_output, communication)``, a sequence-parallel
        row output's gradient all-gathered (in the layouts the GEMMs read), and for a
        column-parallel linear the collectives the core overlaps with its GEMMs (the input
        gathered again for the weight gradient, the input gradient's reduction;
        ``ColumnParallelBackward``), else ``None``."""
        if not self.active:
            return grad_output, None
        if self.mode == "column":
            # each backward: a second one (retain_graph=True) unpacks the shard again
            kept = ctx.kept_shard if self.gathers_input else None
            # the core leaves the input gradient 2-D when it communicates: its shape
            ctx.grad_input_shape = (
                ctx.local_input_shape if self.sequence_parallel else saved.inp_shape
            )
            return grad_output, ColumnParallelBackward(
                saved, kept, self.group, self.sequence_parallel,
                pipelined_dgrad=self.overlap is not None and self.overlap.rs_dgrad,
            )  # fmt: skip
        if self.sequence_parallel:
            # gathered now, or by chunks with the input gradient's GEMM (userbuffers_options)
            ctx.grad_input_shape = saved.inp_shape
            return row_backward_grad_output(grad_output, self.group, saved, self.overlap)
        return grad_output, None

    def input_gradient(self, ctx, grad_input, communication):
        """A column-parallel input gradient summed over the group (reduce-scattered back to
        this rank's rows under sequence parallelism), once ``communication`` (from
        :meth:`backward_inputs`) has reduced it."""
        if communication is None or grad_input is None:
            return grad_input if communication is None else communication.input_gradient(None, ())
        return communication.input_gradient(grad_input, ctx.grad_input_shape)
