"""Tensor- and sequence-parallel communication on ``torch.distributed`` (NCCL on GPUs, gloo on
the CPU): upstream's ``te.distributed`` helpers and the autograd regions the parallel modules
put around their GEMMs.

The regions (each an autograd function whose backward is the forward's adjoint):

* :func:`copy_to_tensor_parallel_region`: identity forward, all-reduce of the gradient (the
  input of a column-parallel GEMM without sequence parallelism);
* :func:`reduce_from_tensor_parallel_region`: all-reduce forward, identity backward (the output
  of a row-parallel GEMM);
* :func:`gather_from_sequence_parallel_region`: all-gather along dim 0 forward, reduce-scatter of
  the gradient (the input of a column-parallel GEMM under sequence parallelism);
* :func:`reduce_scatter_to_sequence_parallel_region`: reduce-scatter along dim 0 forward,
  all-gather of the gradient (the output of a row-parallel GEMM under sequence parallelism).

Everything here works on tensors in high precision: a quantized input is dequantized before it
is communicated (FP8 all-gathers are not built).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .quantized_tensor import QuantizedTensorStorage

__all__ = [
    "get_distributed_world_size",
    "get_distributed_rank",
    "gather_along_first_dim",
    "reduce_scatter_along_first_dim",
    "allreduce",
    "set_tensor_model_parallel_attributes",
    "divide",
    "group_contains",
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]

# torch 2.13 renamed the dim-0 collectives (the old names warn); older versions have only those.
_all_gather_dim0 = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_dim0 = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_MODEL_PARALLEL_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def get_distributed_world_size(group=None) -> int:
    """Number of ranks in ``group`` (the default group when ``None``); 1 when
    ``torch.distributed`` is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)


def get_distributed_rank(group=None) -> int:
    """This process's rank in ``group``; 0 when ``torch.distributed`` is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group=group)


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator // denominator``, refusing a remainder (a size split over the TP ranks)."""
    if numerator % denominator:
        raise ValueError(
            f"{what}={numerator} is not divisible by tp_size={denominator}; tensor parallelism "
            "splits it evenly over the ranks, so choose a multiple of tp_size"
        )
    return numerator // denominator


def group_contains(outer, inner) -> bool:
    """Whether every global rank of ``inner`` is in ``outer`` (``None``: the default group)."""
    if outer is None or outer is dist.group.WORLD:
        return True
    outer_ranks = set(dist.get_process_group_ranks(outer))
    inner_group = dist.group.WORLD if inner is None else inner
    return set(dist.get_process_group_ranks(inner_group)) <= outer_ranks


def _high_precision(t):
    if isinstance(t, QuantizedTensorStorage):
        return t.dequantize()
    return t


def gather_along_first_dim(
    inp: torch.Tensor,
    process_group,
    async_op: bool = False,
    quantizer=None,
    output_tensor: torch.Tensor | None = None,
    external_coalescing: bool = False,
):
    """All-gather ``inp`` along dimension 0 over ``process_group``: ``(out, handle)``.

    ``out`` has ``world_size * inp.shape[0]`` rows, rank ``r``'s rows at ``r * inp.shape[0]``.
    ``handle`` is the ``torch.distributed`` work object with ``async_op=True`` (wait on it before
    reading ``out``), else ``None``. With one rank the input comes back as it is. With a
    ``quantizer`` the gathered values come back quantized by it; they are gathered in high
    precision and quantized afterwards (FP8 all-gathers are not built), so the call is then
    synchronous. ``output_tensor`` receives the gathered values when given.
    ``external_coalescing`` only matters to NVFP4 (not built) and is accepted.
    """
    del external_coalescing
    world = get_distributed_world_size(process_group)
    if world == 1:
        if quantizer is not None and not isinstance(inp, QuantizedTensorStorage):
            inp = quantizer.quantize(inp)
        return inp, None
    src = _high_precision(inp)
    if not src.is_contiguous():
        src = src.contiguous()
    shape = (src.shape[0] * world, *src.shape[1:])
    if output_tensor is None:
        out = torch.empty(shape, dtype=src.dtype, device=src.device)
    else:
        if tuple(output_tensor.shape) != shape:
            raise ValueError(
                f"gather_along_first_dim: output_tensor has shape {tuple(output_tensor.shape)} "
                f"but the gather produces {shape}"
            )
        out = output_tensor
    asynchronous = async_op and quantizer is None
    handle = _all_gather_dim0(out, src, group=process_group, async_op=asynchronous)
    if quantizer is not None:
        out = quantizer.quantize(out)
    return out, handle


def reduce_scatter_along_first_dim(
    inp: torch.Tensor, tp_group, async_op: bool = False, output: torch.Tensor | None = None
):
    """Sum ``inp`` over ``tp_group`` and keep this rank's slice of dimension 0:
    ``(out, handle)`` with ``out.shape[0] == inp.shape[0] // world_size``.

    Raises ``ValueError`` unless ``inp.shape[0]`` is a multiple of the group's size. With one
    rank the input comes back as it is.
    """
    world = get_distributed_world_size(tp_group)
    if world == 1:
        return inp, None
    if inp.dim() == 0 or inp.shape[0] % world:
        raise ValueError(
            f"reduce_scatter_along_first_dim: the first dimension "
            f"({inp.shape[0] if inp.dim() else 'a 0-d tensor'}) must be divisible by the "
            f"group's size {world}"
        )
    src = inp if inp.is_contiguous() else inp.contiguous()
    shape = (src.shape[0] // world, *src.shape[1:])
    if output is None:
        output = torch.empty(shape, dtype=src.dtype, device=src.device)
    elif tuple(output.shape) != shape:
        raise ValueError(
            f"reduce_scatter_along_first_dim: output has shape {tuple(output.shape)} but the "
            f"reduce-scatter produces {shape}"
        )
    handle = _reduce_scatter_dim0(output, src, group=tp_group, async_op=async_op)
    return output, handle


def allreduce(inp: torch.Tensor, tp_group=None, async_op: bool = False):
    """Sum ``inp`` over ``tp_group`` in place: ``(inp, handle)`` (``handle`` with ``async_op``,
    else ``None``). With one rank nothing happens."""
    if get_distributed_world_size(tp_group) == 1:
        return inp, None
    handle = dist.all_reduce(inp, group=tp_group, async_op=async_op)
    return inp, handle


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Mark ``tensor`` as split over the tensor-parallel ranks along ``dim`` (Megatron-LM's
    ``tensor_model_parallel``, ``partition_dim``, ``partition_stride``). Refuses a tensor that
    is already marked."""
    for name in _MODEL_PARALLEL_ATTRIBUTES:
        if hasattr(tensor, name):
            raise RuntimeError(
                f"set_tensor_model_parallel_attributes: the tensor already has {name}="
                f"{getattr(tensor, name)!r}; its tensor-parallel attributes are set once"
            )
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


# --- autograd regions -------------------------------------------------------------------------


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    return gather_along_first_dim(t, group)[0]


def _reduce_scatter(t: torch.Tensor, group) -> torch.Tensor:
    return reduce_scatter_along_first_dim(t, group)[0]


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    # A fresh tensor: the caller's may be saved by another node (or be a view of one).
    out = t.contiguous().clone()
    return allreduce(out, group)[0]


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, group):  # noqa: D102
        ctx.group = group
        return inp.view_as(inp)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, group):  # noqa: D102
        return _all_reduce(inp, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return grad, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, group):  # noqa: D102
        ctx.group = group
        return _gather(inp, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, group):  # noqa: D102
        ctx.group = group
        return _reduce_scatter(inp, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _gather(grad, ctx.group), None


def _apply(function, plain, inp, group):
    """``function`` as an autograd node in grad mode, else just its forward (``plain``)."""
    if get_distributed_world_size(group) == 1:
        return inp
    if torch.is_grad_enabled():
        return function.apply(inp, group)
    return plain(inp, group)


def copy_to_tensor_parallel_region(inp: torch.Tensor, group) -> torch.Tensor:
    """Identity; the gradient is all-reduced over ``group``."""
    return _apply(_CopyToRegion, lambda t, _: t, inp, group)


def reduce_from_tensor_parallel_region(inp: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) over ``group``; the gradient passes through."""
    return _apply(_ReduceFromRegion, _all_reduce, inp, group)


def gather_from_sequence_parallel_region(inp: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 over ``group``; the gradient is reduce-scattered."""
    return _apply(_GatherFromSequenceRegion, _gather, inp, group)


def reduce_scatter_to_sequence_parallel_region(inp: torch.Tensor, group) -> torch.Tensor:
    """Reduce-scatter (sum) along dim 0 over ``group``; the gradient is all-gathered."""
    return _apply(_ReduceScatterToSequenceRegion, _reduce_scatter, inp, group)
