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

FP8 all-gather: :func:`gather_along_first_dim` with a per-tensor FP8 quantizer casts this
rank's rows first and all-gathers the FP8 bytes with the shared ``scale_inv`` (every rank casts
with one scale: delayed scaling by amaxes reduced over a group containing this one, current
scaling by the local amax all-reduced (MAX) here); with a block-scaled quantizer
(:func:`gathers_block_fp8`) the bytes and block scales (:mod:`._block_gather`), bitwise the cast
of the gathered tensor when no block straddles two ranks' rows; otherwise the values are
gathered in high precision and quantized afterwards. The reduce-scatters and all-reduces always
run in high precision.

The GEMMs under sequence parallelism use it three times (when the GEMM runs its FP8 backward
on a per-tensor FP8 recipe, or a block-scaled one where the gather is exact):
:func:`sequence_parallel_gemm_input` gathers a column-parallel input in FP8 and hands back the
local FP8 shard, which is all that is saved for backward; :func:`regather_fp8_shard` gathers
that shard again in backward for the weight gradient (per-tensor: the transposed copy is built
from the gathered bytes; block-scaled: the shard is the local column-wise copy, cast in the
forward, and that is what is gathered); :func:`sequence_parallel_grad_output` gathers a
row-parallel layer's output gradient in FP8, cast with its grad-output quantizer.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ._block_gather import cast_local_rows, gather_block_cast, gathers_exactly, is_block_quantizer
from .quantized_tensor import QuantizedTensorStorage
from .tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor
from .tensor.storage.float8_tensor_storage import Float8TensorStorage

__all__ = [
    "get_distributed_world_size",
    "get_distributed_rank",
    "gather_along_first_dim",
    "gathers_fp8",
    "gathers_block_fp8",
    "sequence_parallel_gemm_input",
    "regather_fp8_shard",
    "sequence_parallel_grad_output",
    "reduce_scatter_along_first_dim",
    "allreduce",
    "set_tensor_model_parallel_attributes",
    "initialize_affine_weight_gpu",
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


def gathers_fp8(quantizer) -> bool:
    """Whether :func:`gather_along_first_dim` moves per-tensor FP8 bytes for ``quantizer``: the
    per-tensor FP8 quantizers (delayed and current scaling). Block-scaled quantizers are
    :func:`gathers_block_fp8`'s."""
    return isinstance(quantizer, (Float8Quantizer, Float8CurrentScalingQuantizer))


def gathers_block_fp8(quantizer) -> bool:
    """Whether :func:`gather_along_first_dim` may move block-scaled FP8 bytes and scales for
    ``quantizer`` (``Float8BlockQuantizer``, ``MXFP8Quantizer``): it does for a high-precision
    input of at least 2 dimensions whose copies asked for gather exactly (see
    :func:`._block_gather.gathers_exactly`), else it gathers in high precision."""
    return is_block_quantizer(quantizer)


def _block_gather_exact(inp, quantizer, *, rowwise: bool, columnwise: bool) -> bool:
    """Whether ``inp`` (this rank's rows, high precision) gathers as block-scaled FP8 bytes."""
    return (
        gathers_block_fp8(quantizer)
        and not isinstance(inp, QuantizedTensorStorage)
        and gathers_exactly(quantizer, inp.shape, rowwise=rowwise, columnwise=columnwise)
    )


def _gather_block(inp, group, quantizer, *, rowwise, columnwise, internal, async_op=False,
                  output_tensor=None, copies=("rowwise", "columnwise")):  # fmt: skip
    """``inp``'s rows cast here with the given copies, those of them in ``copies`` gathered as
    bytes and scales: ``(gathered, handle, local)``."""
    local = cast_local_rows(quantizer, inp, rowwise=rowwise, columnwise=columnwise)
    world = get_distributed_world_size(group)
    gathered, handle = gather_block_cast(
        local, group, world, _all_gather_dim0, internal=internal, async_op=async_op,
        output_tensor=output_tensor, copies=copies,
    )  # fmt: skip
    return gathered, handle, local


def _output_buffer(shape, like: torch.Tensor, output_tensor):
    if output_tensor is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(output_tensor.shape) != tuple(shape) or output_tensor.dtype != like.dtype:
        raise ValueError(
            f"gather_along_first_dim: output_tensor is {output_tensor.dtype} of shape "
            f"{tuple(output_tensor.shape)} but the gather produces {like.dtype} of shape "
            f"{tuple(shape)}"
        )
    return output_tensor


def _cast_rows(quantizer, src: torch.Tensor, group):
    """This rank's rows in FP8, row-wise bytes only, with the scale every rank of ``group``
    computes: a current-scaling quantizer that does not reduce its amax already reduces it
    (MAX) over ``group`` for this cast. The quantizer's usages and reduction are restored."""
    usages = (quantizer.rowwise_usage, quantizer.columnwise_usage)
    reduction = getattr(quantizer, "with_amax_reduction", None)
    group_before = getattr(quantizer, "amax_reduction_group", None)
    quantizer.set_usage(rowwise=True, columnwise=False)
    if reduction is False:
        quantizer.with_amax_reduction, quantizer.amax_reduction_group = True, group
    try:
        return quantizer.quantize_impl(src)
    finally:
        quantizer.set_usage(rowwise=usages[0], columnwise=usages[1])
        if reduction is False:
            quantizer.with_amax_reduction, quantizer.amax_reduction_group = False, group_before


def _gather_fp8(inp, group, world, quantizer, async_op, output_tensor):
    """All-gather of FP8 bytes: ``inp`` cast here (or already a per-tensor FP8 tensor with
    row-wise bytes), its ``_data`` gathered, the result wrapped with the shared ``scale_inv``
    as ``quantizer`` would return it (storage when ``internal``), with its usages:
    ``(result, handle, local)``, ``local`` being this rank's FP8 rows."""
    if isinstance(inp, Float8TensorStorage):
        local = inp
    else:
        src = inp if inp.is_contiguous() else inp.contiguous()
        local = _cast_rows(quantizer, src, group)
    data = local._data if local._data.is_contiguous() else local._data.contiguous()
    shape = (data.shape[0] * world, *data.shape[1:])
    out = _output_buffer(shape, data, output_tensor)
    rowwise, columnwise = quantizer.rowwise_usage, quantizer.columnwise_usage
    # The transposed copy is built from the gathered bytes: only a row-wise result can be
    # handed back before the gather completes.
    asynchronous = async_op and not columnwise
    handle = _all_gather_dim0(out, data, group=group, async_op=asynchronous)
    if quantizer.internal:
        result = Float8TensorStorage._from_cast(
            data=out, transpose=None, scale_inv=local._scale_inv, fp8_dtype=local._fp8_dtype,
            quantizer=local._quantizer, fake_dtype=local._dtype,
        )  # fmt: skip
    else:
        result = Float8Tensor(
            shape, local._dtype, data=out, fp8_scale_inv=local._scale_inv,
            fp8_dtype=local._fp8_dtype, quantizer=local._quantizer,
        )  # fmt: skip
    if columnwise or not rowwise:
        result.update_usage(rowwise_usage=rowwise, columnwise_usage=columnwise)
    return result, handle, local


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
    reading ``out``), else ``None``. With one rank the input comes back as it is (quantized
    when a ``quantizer`` is given).

    With a per-tensor FP8 ``quantizer`` (:func:`gathers_fp8`) the FP8 bytes are gathered: this
    rank's rows are cast (row-wise; a current-scaling quantizer reduces the amax over the group
    first so every rank casts with one scale; delayed scaling relies on amaxes reduced over a
    group containing this one), the ``uint8`` data is all-gathered and wrapped with the shared
    ``scale_inv``; the transposed copy, when the quantizer's usages ask for it, is built from
    the gathered bytes (the call is then synchronous). An input that already is a per-tensor
    FP8 tensor with row-wise bytes is gathered as it is.

    With a block-scaled ``quantizer`` (:func:`gathers_block_fp8`) and a high-precision input
    of at least 2 dimensions, this rank's rows are cast with the quantizer's copies and the
    bytes and block scales are gathered (the scales laid out, padding included, as the cast of
    the gathered tensor lays them out), bitwise that cast, when no block straddles two ranks:
    the row-wise 1x128 (``Float8BlockScaling``) / 1x32 (MXFP8) tiles always; the column-wise
    copy, 128x128 and 32x32 blocks only when ``inp``'s rows (all dimensions but the last) are
    a multiple of the block (128 / 32). With a row-wise copy only, ``async_op`` returns before
    the bytes arrive (the scales travel first). Otherwise it falls back to the path of other
    quantizers: the values are gathered in high precision and quantized afterwards
    (synchronous). ``output_tensor`` receives the gathered values (the ``uint8`` row-wise
    bytes on the FP8 paths) when given.
    ``external_coalescing`` only matters to NVFP4 (not built) and is accepted.
    """
    del external_coalescing
    world = get_distributed_world_size(process_group)
    if world == 1:
        if quantizer is not None and not isinstance(inp, QuantizedTensorStorage):
            inp = quantizer.quantize(inp)
        return inp, None
    if gathers_fp8(quantizer) and (
        not isinstance(inp, QuantizedTensorStorage)
        or (isinstance(inp, Float8TensorStorage) and inp._data is not None)
    ):
        return _gather_fp8(inp, process_group, world, quantizer, async_op, output_tensor)[:2]
    if quantizer is not None and (output_tensor is None or quantizer.rowwise_usage):
        rowwise, columnwise = quantizer.rowwise_usage, quantizer.columnwise_usage
        if _block_gather_exact(inp, quantizer, rowwise=rowwise, columnwise=columnwise):
            return _gather_block(
                inp, process_group, quantizer, rowwise=rowwise, columnwise=columnwise,
                internal=quantizer.internal, async_op=async_op, output_tensor=output_tensor,
            )[:2]  # fmt: skip
    src = _high_precision(inp)
    if not src.is_contiguous():
        src = src.contiguous()
    shape = (src.shape[0] * world, *src.shape[1:])
    out = _output_buffer(shape, src, output_tensor)
    asynchronous = async_op and quantizer is None
    handle = _all_gather_dim0(out, src, group=process_group, async_op=asynchronous)
    if quantizer is not None:
        out = quantizer.quantize(out)
    return out, handle


def _gather_fp8_storage(inp, group, quantizer, *, rowwise: bool, columnwise: bool):
    """:func:`_gather_fp8` of ``inp`` (2-D) as internal storage with the given usages:
    ``(gathered, local)``. The quantizer's usages and ``internal`` flag are restored."""
    usages, internal = (quantizer.rowwise_usage, quantizer.columnwise_usage), quantizer.internal
    quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    quantizer.internal = True
    try:
        world = get_distributed_world_size(group)
        gathered, _, local = _gather_fp8(inp, group, world, quantizer, False, None)
    finally:
        quantizer.set_usage(rowwise=usages[0], columnwise=usages[1])
        quantizer.internal = internal
    return gathered, local


def _fp8_backward(config, quantizer, world: int) -> bool:
    """Whether a GEMM of ``config`` casts ``quantizer``'s operand in per-tensor FP8 (forward
    and backward), so that its sequence-parallel gathers can move FP8 bytes."""
    return config.fp8 and config.backward_override is None and world > 1 and gathers_fp8(quantizer)


def _block_backward(config, quantizer, world: int) -> bool:
    """Whether a GEMM of ``config`` casts ``quantizer``'s operand in block-scaled FP8 (forward
    and backward), so that its sequence-parallel gathers may move FP8 bytes and scales."""
    return (
        config.fp8
        and config.backward_override is None
        and world > 1
        and gathers_block_fp8(quantizer)
    )


def sequence_parallel_gemm_input(inp: torch.Tensor, group, config):
    """A column-parallel GEMM's input under sequence parallelism, all-gathered over ``group``:
    ``(gemm_input, leading_shape, shard)``, ``leading_shape`` being the gathered input's leading
    dimensions (the GEMM output's, before its features).

    When the GEMM runs in FP8 on a per-tensor FP8 input quantizer (``config.fp8``, no
    ``backward_override``, no ``save_original_input``), the gather moves FP8 bytes:
    ``gemm_input`` is a 2-D FP8 storage with row-wise bytes, cast with the scale of the whole
    gathered tensor (the GEMM takes it as it is), and ``shard`` this rank's rows of it (FP8
    storage, row-wise), which is what the caller keeps for the weight gradient
    (:func:`regather_fp8_shard` in backward); an input a fused producer already wrote in FP8
    with that quantizer (2-D) is gathered as it is. With a block-scaled input quantizer under the
    same conditions, when this rank's rows (tokens) are a multiple of the block (128 / 32, so
    the column-wise tiles along the tokens lie inside one rank), the local rows are cast with
    both copies: the row-wise bytes and scales are gathered into ``gemm_input`` (bitwise the
    cast of the gathered input) and ``shard`` is the local column-wise copy, which the weight
    gradient reads once gathered. Otherwise ``gemm_input`` is the gathered high-precision
    tensor and ``shard`` is ``None``.
    """
    world = get_distributed_world_size(group)
    quantizer = config.input_quantizer
    produced = isinstance(inp, Float8TensorStorage) and not isinstance(inp, torch.Tensor)
    if produced and inp._data is not None and _fp8_backward(config, quantizer, world):
        # a fused producer's FP8 rows (2-D, cast with the scale every rank shares): gathered
        # as they are, and kept as the shard
        gathered, shard = _gather_fp8_storage(inp, group, quantizer, rowwise=True, columnwise=False)
        return gathered, (inp.shape[0] * world,), shard
    leading = (inp.shape[0] * world, *inp.shape[1:-1]) if inp.dim() else ()
    fp8_gather = (
        _fp8_backward(config, quantizer, world)
        and not config.save_original_input
        and not isinstance(inp, QuantizedTensorStorage)
    )
    block_gather = (
        not fp8_gather
        and not config.save_original_input
        and not isinstance(inp, QuantizedTensorStorage)
        and inp.dim() > 0
        and _block_backward(config, quantizer, world)
    )
    src = inp.reshape(-1, inp.shape[-1]) if block_gather else inp
    if block_gather and _block_gather_exact(src, quantizer, rowwise=True, columnwise=True):
        gathered, _, shard = _gather_block(
            src, group, quantizer, rowwise=True, columnwise=True, internal=True,
            copies=("rowwise",),
        )  # fmt: skip
        shard.update_usage(rowwise_usage=False, columnwise_usage=True)
        return gathered, leading, shard
    if not fp8_gather:
        return gather_along_first_dim(inp, group)[0], leading, None
    gathered, shard = _gather_fp8_storage(
        inp.reshape(-1, inp.shape[-1]), group, quantizer, rowwise=True, columnwise=False
    )
    return gathered, leading, shard


def regather_fp8_shard(shard, group, async_op: bool = False):
    """The FP8 shard :func:`sequence_parallel_gemm_input` handed out, all-gathered again over
    ``group`` (its bytes, with its ``scale_inv``) with only the transposed copy the weight
    gradient reads (built from the gathered bytes): equal to the gathered input's. A
    block-scaled shard (its local column-wise copy) is gathered as bytes and scales: the
    column-wise copy of the cast of the gathered input. With ``async_op`` the per-tensor bytes
    are still in flight when the call returns: it returns a function that waits for them and
    gives the result (the block-scaled gather is done by then)."""
    world = get_distributed_world_size(group)
    if not isinstance(shard, Float8TensorStorage):
        gathered = gather_block_cast(shard, group, world, _all_gather_dim0, internal=True)[0]
        return (lambda: gathered) if async_op else gathered
    data = shard._data if shard._data.is_contiguous() else shard._data.contiguous()
    out = torch.empty(
        (data.shape[0] * world, *data.shape[1:]), dtype=data.dtype, device=data.device
    )
    handle = _all_gather_dim0(out, data, group=group, async_op=async_op)

    def finish():
        if handle is not None:
            handle.wait()
        gathered = Float8TensorStorage._from_cast(
            data=out, transpose=None, scale_inv=shard._scale_inv, fp8_dtype=shard._fp8_dtype,
            quantizer=shard._quantizer, fake_dtype=shard._dtype,
        )  # fmt: skip
        gathered.update_usage(rowwise_usage=False, columnwise_usage=True)
        return gathered

    return finish if async_op else finish()


def sequence_parallel_grad_output(
    grad: torch.Tensor, group, config, *, rowwise: bool, columnwise: bool
):
    """A row-parallel GEMM's output gradient under sequence parallelism (this rank's rows),
    all-gathered over ``group``.

    When the GEMM's backward runs in per-tensor FP8 and reads the gradient (``rowwise``: the
    input gradient, ``columnwise``: the weight gradient), the local rows are cast with
    ``config.grad_output_quantizer`` (current scaling: the amax reduced over ``group`` first,
    so every rank casts with the scale of the whole gradient; delayed scaling: the shared
    scale) and the FP8 bytes are gathered: a 2-D FP8 storage with those usages, which the
    GEMMs take as it is. The same with a block-scaled grad-output quantizer when the copies
    asked for gather exactly (the row-wise copy always, the column-wise one when this rank's
    rows are a multiple of the block: 128 / 32); otherwise the gradient is gathered in high
    precision.
    """
    world = get_distributed_world_size(group)
    quantizer = config.grad_output_quantizer
    if (rowwise or columnwise) and _block_backward(config, quantizer, world):
        src = grad.reshape(-1, grad.shape[-1])
        if _block_gather_exact(src, quantizer, rowwise=rowwise, columnwise=columnwise):
            return _gather_block(
                src, group, quantizer, rowwise=rowwise, columnwise=columnwise, internal=True
            )[0]
    if not ((rowwise or columnwise) and _fp8_backward(config, quantizer, world)):
        return gather_along_first_dim(grad, group)[0]
    src = grad.reshape(-1, grad.shape[-1])
    return _gather_fp8_storage(src, group, quantizer, rowwise=rowwise, columnwise=columnwise)[0]


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


def initialize_affine_weight_gpu(
    weight: torch.Tensor,
    init_method,
    get_rng_state_tracker=None,
    partition_dim: int = 0,
    stride: int = 1,
    set_tp_attributes: bool = True,
) -> None:
    """Initialize this rank's shard ``weight`` in place with ``init_method`` (Megatron-LM's
    helper): inside ``get_rng_state_tracker().fork()`` when a tracker getter is given, so the
    ranks' shards draw different values and the default generator is left alone; with
    ``set_tp_attributes``, mark it split along ``partition_dim`` first."""
    if not callable(init_method):
        raise TypeError(
            f"initialize_affine_weight_gpu: init_method must be callable (it fills the weight "
            f"in place), got {type(init_method).__name__}"
        )
    if set_tp_attributes:
        set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    if get_rng_state_tracker is None:
        fork = contextlib.nullcontext()
    else:
        fork = get_rng_state_tracker().fork()
    with fork, torch.no_grad():
        init_method(weight)


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
