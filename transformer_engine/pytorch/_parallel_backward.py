"""A column-parallel GEMM's backward communication, overlapped with its GEMMs.

A column-parallel GEMM's input gradient is a partial sum over the tensor-parallel ranks: it is
all-reduced, or under sequence parallelism reduce-scattered back to this rank's rows, whose
input the backward must also all-gather again for the weight gradient (only the local shard was
kept). Run in sequence with the GEMMs, the GPU would idle on each collective; upstream's NCCL
path overlaps them, and so does :class:`ColumnParallelBackward`, through the hooks the linear
core's backward calls (``functional.linear.linear_backward``'s ``communication``):

1. ``before_dgrad``: the input's all-gather is issued, asynchronously: it runs while the
   input-gradient (dgrad) GEMM computes. Not earlier: collectives of one group run in the order
   they were issued, so one issued before the grad-output cast would hold up that cast's own
   amax all-reduce (current scaling) and with it the dgrad GEMM.
2. ``before_wgrad``: the gather is waited for (the weight-gradient GEMM reads its result).
3. ``dgrad_ready``: the input gradient's reduction is issued, asynchronously (after the gather:
   every rank issues the group's collectives in one order): it runs while the weight-gradient
   (wgrad) GEMM computes.
4. :meth:`ColumnParallelBackward.input_gradient`, after the core's backward: the reduction is
   waited for, and its result is the input gradient.

On a GPU the asynchronous collectives run on the process group's own stream, ordered after the
work already queued on the current stream, and waiting on them makes the current stream wait,
so the results are those of the synchronous order. The modules' linear nodes (``te.Linear``,
``te.LayerNormLinear``, ``LayerNormMLP``'s FC1) and ``te.ops.BasicLinear`` go through it.
"""

from __future__ import annotations

import torch

from ._ring_gemm import gemm_reduce_scatter
from ._sequence_parallel_input import restore_gathered_input
from ._tensor_parallel import allreduce, reduce_scatter_along_first_dim

__all__ = ["ColumnParallelBackward", "column_parallel_backward"]

# False: every collective is waited for as soon as it is issued (the order of a backward
# without overlap), for benchmarks that time both in one run
# (benchmarks/parallel/benchmark_tp_mlp.py --overlap-baseline); read when a backward starts.
OVERLAP = True


def column_parallel_backward(saved, kept, sp_group, in_grad_group, pipelined_dgrad=False):
    """The :class:`ColumnParallelBackward` of a GEMM whose input is gathered over ``sp_group``
    (sequence parallelism) or whose input gradient is all-reduced over ``in_grad_group``;
    ``None`` when neither is set (no communication). ``pipelined_dgrad`` (sequence
    parallelism): the input gradient's GEMM runs chunk by chunk with its reduce-scatter
    (``_ring_gemm.gemm_reduce_scatter``; a module's ``ub_overlap_rs_dgrad``)."""
    if sp_group is None and in_grad_group is None:
        return None
    return ColumnParallelBackward(
        saved, kept, sp_group or in_grad_group, sequence_parallel=sp_group is not None,
        pipelined_dgrad=pipelined_dgrad and sp_group is not None,
    )  # fmt: skip


class ColumnParallelBackward:
    """The collectives of one column-parallel GEMM's backward over ``group`` (see the module
    docstring): ``saved`` is the core's saved state, ``kept`` what the forward kept of a
    sequence-parallel input (``keep_local_shard``'s result), ``sequence_parallel`` whether the
    input gradient is reduce-scattered (else all-reduced)."""

    __slots__ = (
        "saved", "kept", "group", "sequence_parallel", "pipelined_dgrad", "overlap",
        "_gathered", "_reduction",
    )  # fmt: skip

    def __init__(
        self, saved, kept: str | None, group, sequence_parallel: bool, pipelined_dgrad=False
    ) -> None:
        self.saved, self.kept, self.group = saved, kept, group
        self.sequence_parallel = sequence_parallel
        self.pipelined_dgrad = pipelined_dgrad
        self.overlap = OVERLAP
        self._gathered = None  # waits for the input's gather and sets saved.x
        self._reduction = None  # (result, work handle) of the input gradient's reduction

    def before_dgrad(self) -> None:
        """Issue the input's all-gather (asynchronous; without :data:`OVERLAP`, not yet)."""
        if self.overlap:
            self._issue_gather()

    def _issue_gather(self) -> None:
        self._gathered = restore_gathered_input(self.saved, self.kept, self.group)
        self.kept = None

    def dgrad(self, gemm, grad_operand):
        """The input-gradient GEMM; with ``pipelined_dgrad`` run chunk by chunk with its
        reduce-scatter, whose result is then the reduction :meth:`input_gradient` returns."""
        if not self.pipelined_dgrad:
            return gemm(grad_operand)
        dx = gemm_reduce_scatter(grad_operand, self.group, gemm)
        self._reduction = (dx, None)
        return dx

    def wgrad_operand(self, grad_operand):
        """The output gradient as the weight gradient reads it (unchanged: not split)."""
        return grad_operand

    def before_wgrad(self) -> None:
        """Wait for the input's all-gather (issuing it first if that has not happened)."""
        if self.kept is not None:
            self._issue_gather()
        if self._gathered is not None:
            self._gathered()
            self._gathered = None

    def dgrad_ready(self, dx: torch.Tensor) -> None:
        """Issue the reduction of the input gradient ``dx`` (asynchronous; an all-reduce sums
        ``dx`` in place: it is the GEMM's own output)."""
        self.before_wgrad()  # the gather first, on every rank
        if self._reduction is not None:  # reduced by the pipelined GEMM already
            return
        if self.sequence_parallel:
            self._reduction = reduce_scatter_along_first_dim(dx, self.group, async_op=True)
        else:
            self._reduction = allreduce(dx, self.group, async_op=True)
        handle = self._reduction[1]
        if not self.overlap and handle is not None:
            handle.wait()

    def input_gradient(self, dx: torch.Tensor | None, shape) -> torch.Tensor | None:
        """The input gradient summed over the group (this rank's rows under sequence
        parallelism) in ``shape``, once its reduction is done (issued here if the core did
        not)."""
        self.before_wgrad()
        if dx is None:
            return None
        if self._reduction is None:
            self.dgrad_ready(dx.reshape(-1, dx.shape[-1]))
        out, handle = self._reduction
        self._reduction = None
        if handle is not None:
            handle.wait()
        return out.view(shape)  # the reduce-scatter's output, or dx summed in place
