"""Tensor-parallel GEMMs pipelined with their collectives, chunk by chunk over the group's ranks
(what upstream's userbuffers overlaps do; turned on by a module's ``ub_*`` flags, see
:mod:`._userbuffers`).

Under sequence parallelism a column-parallel GEMM needs its input all-gathered, and a
row-parallel GEMM's output is reduce-scattered. Done as one collective, the GEMM waits for the
whole gather, or the reduction for the whole GEMM. Split by rows into one chunk per rank, each
chunk's transfer runs while the GEMM of another chunk computes:

* :func:`all_gather_gemm` (ring exchange): at step ``s`` rank ``r`` multiplies the chunk of rank
  ``r - s`` while it sends that chunk to rank ``r + 1`` and receives chunk ``r - s - 1`` from
  rank ``r - 1``; after ``world`` steps it has the output rows of every chunk. FP8 operands
  move as FP8 bytes (the chunks share the scale every rank casts with).
* :func:`gemm_reduce_scatter` (pipeline): at step ``s`` rank ``r`` computes its partial product
  of output chunk ``r + s + 1``, adds the partial sum rank ``r + 1`` sent it for that chunk and
  sends the result on to rank ``r - 1``; after ``world`` steps it holds the sum over the ranks
  of its own chunk (summed in the output dtype, as a reduce-scatter of that dtype does).

The transfers are ``torch.distributed`` point-to-point operations issued in pairs
(``batch_isend_irecv``: on NCCL they run on the group's stream, after the work already queued,
and waiting for them makes the current stream wait). Every rank of the group must take part.

:class:`PipelinedForward` is the forward hook the linear core takes (``forward_gemm``);
:class:`RowParallelGradGather` the backward communication of a row-parallel GEMM whose output
gradient is gathered chunk by chunk with its input-gradient GEMM.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._sequence_parallel_input import keep_local_shard, mark_kept_shard
from ._tensor_parallel import (
    _cast_rows,
    gather_along_first_dim,
    gathers_fp8,
    get_distributed_world_size,
    reduce_scatter_along_first_dim,
    sequence_parallel_gemm_input,
    sequence_parallel_grad_output,
)
from .quantized_tensor import QuantizedTensorStorage
from .tensor.storage.float8_tensor_storage import Float8TensorStorage

__all__ = [
    "all_gather_gemm",
    "gemm_reduce_scatter",
    "PipelinedForward",
    "RowParallelGradGather",
    "column_forward_input",
    "keep_column_input",
    "row_forward_gemm",
    "row_forward_output",
    "row_backward_grad_output",
]


def _chunkable(operand) -> bool:
    """A plain 2-D tensor, or per-tensor FP8 storage with its row-wise bytes."""
    if isinstance(operand, Float8TensorStorage):
        return operand._data is not None
    return isinstance(operand, torch.Tensor) and operand.dim() == 2


def _payload(operand) -> torch.Tensor:
    data = operand._data if isinstance(operand, Float8TensorStorage) else operand
    return data if data.is_contiguous() else data.contiguous()


def _wrap(like, payload: torch.Tensor):
    """``payload`` (rows of ``like``'s bytes or values) as a GEMM operand like ``like``."""
    if not isinstance(like, Float8TensorStorage):
        return payload
    return Float8TensorStorage._from_cast(
        data=payload, transpose=None, scale_inv=like._scale_inv, fp8_dtype=like._fp8_dtype,
        quantizer=like._quantizer, fake_dtype=like._dtype,
    )  # fmt: skip


def _neighbours(group) -> tuple[int, int, int, int]:
    """``(world, rank, next, previous)``: the group's size, this rank's index in it, and the
    global ranks of the ring's next and previous members."""
    group = group if group is not None else dist.group.WORLD
    world = get_distributed_world_size(group)
    rank = dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    return world, rank, nxt, prv


def _exchange(send: torch.Tensor, recv: torch.Tensor, to: int, source: int, group) -> list:
    """Send ``send`` to global rank ``to`` while receiving ``recv`` from ``source``: the work
    objects to wait for."""
    if send.device.type != "cpu" and dist.get_backend(group) == "gloo":
        # gloo moves host memory only: through host copies (a CPU test of GPU kernels)
        host = torch.empty(recv.shape, dtype=recv.dtype)
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, send.cpu(), to, group),
             dist.P2POp(dist.irecv, host, source, group)]
        )  # fmt: skip
        return [_HostStagedWork(works, host, recv)]
    return dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, source, group)]
    )


class _HostStagedWork:
    """Waits for a gloo exchange and copies what arrived in host memory to the device."""

    def __init__(self, works, host: torch.Tensor, recv: torch.Tensor) -> None:
        self.works, self.host, self.recv = works, host, recv

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.recv.copy_(self.host)
        return True


def _wait(works) -> None:
    for work in works:
        work.wait()


def _gemm_into(gemm, operand, out: torch.Tensor, rows: slice) -> None:
    """Run ``gemm`` on ``operand`` into ``out[rows]`` (``gemm(operand, out=view)`` may write
    the view itself; a GEMM that cannot is copied in)."""
    view = out[rows]
    result = gemm(operand, out=view)
    if result.data_ptr() != view.data_ptr():
        view.copy_(result)


def all_gather_gemm(local, group, gemm, *, keep_gathered: bool = False):
    """``gemm`` of ``local`` all-gathered along dimension 0 over ``group``, computed one rank's
    chunk at a time while the next chunk travels (ring exchange): ``(out, gathered)``.

    ``local``: this rank's rows (a 2-D tensor, or per-tensor FP8 storage with row-wise bytes
    cast with the scale every rank shares); ``gemm(operand, out=None)``: the GEMM of some rows
    (it may write ``out``, a view of the result's rows). ``out`` has ``world`` times the rows,
    rank ``i``'s at ``i * rows``, as the GEMM of the gathered operand. ``gathered``: with
    ``keep_gathered``, that operand (FP8 storage with row-wise bytes for an FP8 ``local``),
    else ``None``."""
    world, rank, nxt, prv = _neighbours(group)
    if world == 1:
        return gemm(local), (local if keep_gathered else None)
    payload = _payload(local)
    m = payload.shape[0]
    received = torch.empty((world * m, *payload.shape[1:]), dtype=payload.dtype,
                           device=payload.device)  # fmt: skip
    if keep_gathered:
        received[rank * m : (rank + 1) * m].copy_(payload)
    out, current, works = None, payload, []
    for step in range(world):
        chunk = (rank - step) % world
        if step < world - 1:
            incoming = (chunk - 1) % world
            works = _exchange(current, received[incoming * m : (incoming + 1) * m], nxt, prv, group)
        rows = slice(chunk * m, (chunk + 1) * m)
        if out is None:
            first = gemm(_wrap(local, current))
            out = first.new_empty((world * m, *first.shape[1:]))
            out[rows].copy_(first)
        else:
            _gemm_into(gemm, _wrap(local, current), out, rows)
        _wait(works)
        works = []
        if step < world - 1:
            current = received[incoming * m : (incoming + 1) * m]
    return out, (_wrap(local, received) if keep_gathered else None)


def gemm_reduce_scatter(operand, group, gemm):
    """``gemm`` of ``operand`` summed over ``group`` and split along dimension 0, this rank's
    rows kept (a reduce-scatter), computed chunk by chunk with each partial sum travelling
    while the next chunk's GEMM runs (pipeline). ``operand``: the GEMM's row operand (a 2-D
    tensor or per-tensor FP8 storage with row-wise bytes), rows a multiple of the group's
    size; ``gemm(operand, out=None)`` as in :func:`all_gather_gemm`. An operand that cannot be
    split by rows (block-scaled storage) runs as one GEMM and one reduce-scatter."""
    world, rank, nxt, prv = _neighbours(group)
    if world == 1:
        return gemm(operand)
    if not _chunkable(operand):
        return reduce_scatter_along_first_dim(gemm(operand), group)[0]
    payload = _payload(operand)
    if payload.shape[0] % world:
        raise ValueError(
            f"gemm_reduce_scatter: the GEMM's {payload.shape[0]} rows must be a multiple of "
            f"the tensor-parallel size ({world}) to be reduce-scattered"
        )
    m = payload.shape[0] // world
    partial, incoming, works, in_flight = None, None, [], None
    for step in range(world):
        chunk = (rank + step + 1) % world
        partial = gemm(_wrap(operand, payload[chunk * m : (chunk + 1) * m]))
        if works:
            _wait(works)
            partial.add_(incoming)
            works, in_flight = [], None
        if step < world - 1:
            incoming = torch.empty_like(partial)
            in_flight = partial  # held until the send is done
            works = _exchange(partial, incoming, prv, nxt, group)
    del in_flight
    return partial


def cast_fp8_rows(quantizer, rows: torch.Tensor, group):
    """This rank's rows cast to FP8 storage (row-wise bytes) with the scale every rank of
    ``group`` casts with (current scaling: the amax reduced over the group)."""
    internal = quantizer.internal
    quantizer.internal = True
    try:
        return _cast_rows(quantizer, rows if rows.is_contiguous() else rows.contiguous(), group)
    finally:
        quantizer.internal = internal


def ring_operand_ok(config, quantizer, world: int) -> bool:
    """Whether a gathered GEMM operand can travel by chunks: in high precision (no FP8), or as
    per-tensor FP8 bytes (the backward too in FP8: no ``backward_override``; no
    ``save_original_input``). Other recipes gather as one collective."""
    if world < 2:
        return False
    if not config.fp8:
        return True
    return (
        config.backward_override is None
        and not config.save_original_input
        and gathers_fp8(quantizer)
    )


def column_ring_input(inp: torch.Tensor, group, config):
    """A column-parallel GEMM input (this rank's rows) ready for :func:`all_gather_gemm`:
    ``(local, shard, rows)``: ``local`` the 2-D operand (FP8 storage cast with the scale
    every rank shares, or the high-precision rows), ``shard`` the FP8 storage (``None`` in
    high precision), ``rows`` the gathered row count."""
    world = get_distributed_world_size(group)
    local = inp.reshape(-1, inp.shape[-1])
    shard = None
    if config.fp8:
        shard = local = cast_fp8_rows(config.input_quantizer, local, group)
    return local, shard, local.shape[0] * world


class PipelinedForward:
    """The linear core's ``forward_gemm`` hook: the forward GEMM run with its all-gather
    (``gather=True``, column-parallel) or its reduce-scatter (row-parallel) over ``group``."""

    __slots__ = ("group", "gather")

    def __init__(self, group, gather: bool) -> None:
        self.group, self.gather = group, gather

    def __call__(self, gemm, operand):
        if self.gather:
            return all_gather_gemm(operand, self.group, gemm)[0]
        return gemm_reduce_scatter(operand, self.group, gemm)


class RowParallelGradGather:
    """The backward communication (``linear_backward``'s ``communication``) of a row-parallel
    GEMM under sequence parallelism whose output gradient arrives as this rank's rows: the
    input-gradient GEMM runs chunk by chunk while the gradient's chunks travel
    (:func:`all_gather_gemm`), and the weight gradient reads the gathered gradient (in FP8 with
    the transposed copy it needs built from the gathered bytes)."""

    __slots__ = ("group", "_gathered")

    def __init__(self, group) -> None:
        self.group, self._gathered = group, None

    def before_dgrad(self) -> None:  # noqa: D102
        pass

    def before_wgrad(self) -> None:  # noqa: D102
        pass

    def dgrad(self, gemm, operand):
        """The input gradient, its GEMM pipelined with the gradient's all-gather."""
        out, self._gathered = all_gather_gemm(operand, self.group, gemm, keep_gathered=True)
        return out

    def wgrad_operand(self, operand):
        """The whole output gradient for the weight-gradient GEMM (gathered here when the
        input gradient was not computed)."""
        gathered, self._gathered = self._gathered, None
        if gathered is None:
            if isinstance(operand, Float8TensorStorage):
                data = gather_along_first_dim(_payload(operand), self.group)[0]
                gathered = _wrap(operand, data)
            else:
                gathered = gather_along_first_dim(operand, self.group)[0]
        if isinstance(gathered, Float8TensorStorage):
            gathered.update_usage(rowwise_usage=False, columnwise_usage=True)
        return gathered

    def dgrad_ready(self, dx) -> None:  # noqa: D102
        pass

    def input_gradient(self, dx, shape):
        """The input gradient in ``shape`` (the row layer's input is not split by rows)."""
        return None if dx is None else dx.reshape(shape)


# -- where a tensor-parallel GEMM node's collectives go: one collective, or pipelined --------


def column_forward_input(inp: torch.Tensor, group, config, overlap):
    """A column-parallel GEMM input under sequence parallelism (this rank's rows), for the
    core's forward: ``(gemm_input, leading, shard, forward_gemm, ring_rows)``. With
    ``overlap.ag_fprop`` and an operand that travels by chunks, ``gemm_input`` stays this
    rank's rows and ``forward_gemm`` gathers them with the GEMM (``ring_rows``: the gathered
    row count); otherwise ``sequence_parallel_gemm_input`` gathers first (``forward_gemm`` and
    ``ring_rows`` ``None``). ``leading``: the output's leading dimensions."""
    world = get_distributed_world_size(group)
    if (
        overlap is not None
        and overlap.ag_fprop
        and inp.dim() > 1
        and not isinstance(inp, QuantizedTensorStorage)
        and ring_operand_ok(config, config.input_quantizer, world)
    ):
        local, shard, rows = column_ring_input(inp, group, config)
        leading = (inp.shape[0] * world, *inp.shape[1:-1])
        return local, leading, shard, PipelinedForward(group, gather=True), rows
    full, leading, shard = sequence_parallel_gemm_input(inp, group, config)
    return full, leading, shard, None, None


def keep_column_input(saved, inp, full, shard, needs_wgrad: bool, ring_rows) -> str | None:
    """After the core's forward on :func:`column_forward_input`'s result: keep this rank's
    shard for the backward (what it must gather again, as ``keep_local_shard`` says)."""
    if ring_rows is None:
        return keep_local_shard(saved, inp, full, shard, needs_wgrad)
    # the input gradient comes out with the gathered rows, before its reduce-scatter
    saved.inp_shape = (ring_rows, saved.inp_shape[-1])
    return mark_kept_shard(saved, shard, needs_wgrad)


def row_forward_gemm(inp: torch.Tensor, group, overlap):
    """The ``forward_gemm`` of a row-parallel GEMM under sequence parallelism whose
    reduce-scatter is pipelined (``overlap.rs_fprop``), else ``None``."""
    if overlap is None or not overlap.rs_fprop:
        return None
    world = get_distributed_world_size(group)
    if not len(inp.shape) or inp.shape[0] % world:
        raise ValueError(
            f"the row-parallel GEMM's output is reduce-scattered along dimension 0, whose "
            f"size ({inp.shape[0] if len(inp.shape) else 'a 0-d tensor'}) must be divisible by "
            f"the tensor-parallel size ({world})"
        )
    return PipelinedForward(group, gather=False)


def row_forward_output(out: torch.Tensor, leading, group, forward_gemm) -> torch.Tensor:
    """A row-parallel GEMM's output under sequence parallelism: this rank's rows of the sum
    over ``group`` (reduce-scattered here unless ``forward_gemm`` did it), in ``leading``
    (the output's leading dimensions before the split) with the first one divided."""
    if forward_gemm is None:
        return reduce_scatter_along_first_dim(out.reshape(*leading, out.shape[-1]), group)[0]
    return out.reshape(-1, *leading[1:], out.shape[-1])  # the GEMM's rows: this rank's


def row_backward_grad_output(grad: torch.Tensor, group, saved, overlap):
    """A row-parallel GEMM's output gradient under sequence parallelism (this rank's rows) for
    the core's backward: ``(grad_output, communication)``. With ``overlap.ag_dgrad`` and an
    operand that travels by chunks it stays this rank's rows (FP8 where the backward casts it
    with a per-tensor scale) and ``communication`` (:class:`RowParallelGradGather`) gathers it
    with the input-gradient GEMM; otherwise it is gathered now
    (``sequence_parallel_grad_output``) and ``communication`` is ``None``."""
    config = saved.config
    rowwise, columnwise = saved.w is not None, saved.x is not None
    world = get_distributed_world_size(group)
    fp8_backward = config.fp8 and not saved.high_precision_backward
    if (
        overlap is not None
        and overlap.ag_dgrad
        and (rowwise or columnwise)
        and (not fp8_backward or ring_operand_ok(config, config.grad_output_quantizer, world))
    ):
        local = grad.reshape(-1, grad.shape[-1])
        if fp8_backward:
            local = cast_fp8_rows(config.grad_output_quantizer, local, group)
        return local, RowParallelGradGather(group)
    grad = sequence_parallel_grad_output(
        grad, group, config, rowwise=rowwise, columnwise=columnwise
    )
    return grad, None
