"""Collective operations over ``torch.distributed``: ``AllReduce``, ``AllGather`` and
``ReduceScatter``, along the first dimension.

Gradient convention. A tensor that a collective makes is held by every rank of the group, and
each rank's backward receives the gradient of *its own* downstream computation. The backward of
each operation is the exact adjoint of its forward when the loss being differentiated is the sum
of the ranks' losses (what data- and tensor-parallel training computes):

* ``AllGather``: ``y = cat(x_0, .., x_{R-1})`` on every rank; backward ``dx_r`` = rank ``r``'s
  block of ``sum_r' dy_r'`` (a reduce-scatter of the gradient);
* ``ReduceScatter``: ``y_r`` = block ``r`` of ``sum_r' x_r'``; backward
  ``dx_r = cat(dy_0, .., dy_{R-1})`` (an all-gather of the gradient);
* ``AllReduce``: ``y = sum_r x_r`` on every rank; backward with ``reduce_in_backward=True``
  (default) ``dx_r = sum_r' dy_r'`` (an all-reduce of the gradient, the adjoint); with
  ``reduce_in_backward=False`` the gradient passes through (``dx_r = dy_r``), which is right
  when everything downstream is computed redundantly and identically on every rank, so that
  each rank's ``dy`` already is the gradient of the one shared loss (the usual row-parallel
  linear followed by replicated operations).

With one rank every operation is the identity, forward and backward. The operations run on the
input's device (the fuser makes it current) and allocate their outputs there; the input is never
written. NCCL uses the tensor collectives (``all_gather_into_tensor``,
``reduce_scatter_tensor``); other backends (gloo, which has no reduce-scatter) use list
all-gathers, and an all-reduce followed by taking the rank's block for reduce-scatter.
``torch.distributed`` must be initialized.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..op import BasicOperation, OperationContext
from ._common import plain

__all__ = ["AllReduce", "AllGather", "ReduceScatter"]


def _world_size(owner: str, group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{owner}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) first (with one process the operation "
            "is the identity)"
        )
    return dist.get_world_size(group)


def _uses_nccl(tensor: torch.Tensor, group) -> bool:
    return tensor.device.type == "cuda" and "nccl" in str(dist.get_backend(group)).lower()


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group, into a new tensor."""
    out = tensor.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _all_gather(tensor: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """Concatenation of every rank's ``tensor`` along the first dimension (equal shapes)."""
    tensor = tensor.contiguous()
    out = torch.empty(
        (world_size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    if _uses_nccl(tensor, group):
        dist.all_gather_into_tensor(out, tensor, group=group)
    else:
        dist.all_gather(list(out.chunk(world_size)), tensor, group=group)
    return out


def _reduce_scatter(owner: str, tensor: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """This rank's block (first dimension) of the sum over the group."""
    rows = tensor.shape[0]
    if rows % world_size:
        raise ValueError(
            f"{owner}: the first dimension ({rows}) must be divisible by the group's size "
            f"({world_size})"
        )
    tensor = tensor.contiguous()
    if _uses_nccl(tensor, group):
        out = torch.empty(
            (rows // world_size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
        )
        dist.reduce_scatter_tensor(out, tensor, group=group)
        return out
    total = _all_reduce(tensor, group)
    return total.chunk(world_size)[dist.get_rank(group)].clone()


def _check_rank(owner: str, tensor: torch.Tensor) -> None:
    if tensor.dim() == 0:
        raise ValueError(f"{owner}: the input must have at least one dimension (a 0-d tensor)")


class AllReduce(BasicOperation):
    """Sum the input over the processes of ``process_group``; every rank gets the sum.

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, optional
        Default: the world group.
    reduce_in_backward : bool, default True
        ``True``: the gradient is all-reduced too (the adjoint of the forward, for a loss that
        is the sum of the ranks' losses). ``False``: the gradient passes through unchanged, for
        downstream computation that is replicated identically on every rank (see the module
        docstring).
    """

    def __init__(self, process_group=None, reduce_in_backward: bool = True) -> None:
        super().__init__()
        self.process_group = process_group
        self.reduce_in_backward = bool(reduce_in_backward)

    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        *,
        prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None,
    ) -> torch.Tensor:
        world_size = _world_size("AllReduce", self.process_group)
        ctx.world_size = world_size
        if world_size == 1:
            return input_
        return _all_reduce(plain(input_), self.process_group)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        if ctx.world_size == 1 or not self.reduce_in_backward:
            return grad_output, []
        return _all_reduce(plain(grad_output), self.process_group), []


class AllGather(BasicOperation):
    """Concatenate the ranks' inputs along the first dimension (rank order); every rank gets
    the whole. Every rank's input must have the same shape.

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, optional
        Default: the world group.

    The backward reduce-scatters the gradient (the adjoint; see the module docstring).
    """

    def __init__(self, process_group=None) -> None:
        super().__init__()
        self.process_group = process_group

    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        *,
        prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None,
    ) -> torch.Tensor:
        world_size = _world_size("AllGather", self.process_group)
        _check_rank("AllGather", input_)
        ctx.world_size = world_size
        if world_size == 1:
            return input_
        return _all_gather(plain(input_), self.process_group, world_size)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        if ctx.world_size == 1:
            return grad_output, []
        grad = _reduce_scatter("AllGather", plain(grad_output), self.process_group, ctx.world_size)
        return grad, []


class ReduceScatter(BasicOperation):
    """Sum the inputs over the ranks and give rank ``r`` block ``r`` of the sum along the first
    dimension, which must be divisible by the group's size.

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, optional
        Default: the world group.

    The backward all-gathers the gradient (the adjoint; see the module docstring).
    """

    def __init__(self, process_group=None) -> None:
        super().__init__()
        self.process_group = process_group

    def op_forward(
        self,
        ctx: OperationContext,
        input_: torch.Tensor,
        *,
        prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None,
    ) -> torch.Tensor:
        world_size = _world_size("ReduceScatter", self.process_group)
        _check_rank("ReduceScatter", input_)
        ctx.world_size = world_size
        if world_size == 1:
            return input_
        return _reduce_scatter("ReduceScatter", plain(input_), self.process_group, world_size)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor):
        if ctx.world_size == 1:
            return grad_output, []
        return _all_gather(plain(grad_output), self.process_group, ctx.world_size), []
