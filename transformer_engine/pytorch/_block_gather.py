"""FP8 all-gather of block-scaled tensors along dimension 0 (sequence parallelism):
``Float8BlockScaling``'s quantizer (1x128 tiles, 128x128 blocks) and MXFP8's (32-element
blocks, 32x32 with ``with_2d_quantization``).

Each rank casts its own rows; the FP8 bytes and the block scales are all-gathered (as ``uint8``)
and laid out as the cast of the whole gathered tensor would lay them out: the GEMM_READY scale
layouts of ``tensor/storage/float8_blockwise_tensor_storage.py`` and
``tensor/storage/mxfp8_tensor_storage.py``, padding entries zero as the casts write them.

Why it is exact: every block scale comes from its own block's amax and nothing else, so a
block that lies inside one rank's rows is cast alike by that rank and by a cast of the whole
tensor. Row-wise 1x128 / 1x32 tiles run along the last dimension and always lie inside one
row. Blocks that span rows (the column-wise copies' tiles along the tokens, 128x128 and 32x32
blocks) lie inside one rank's rows only when each rank's row count is a multiple of the block;
otherwise the whole tensor has blocks straddling two ranks and :func:`gathers_exactly` says no
(the callers then gather in high precision and cast afterwards).

The collectives are the caller's (``all_gather(out, src, group=..., async_op=...)``, gathering
along dimension 0), so what goes over the wire can be observed in one place.
"""

from __future__ import annotations

import torch

from .cpp_extensions.block_cast import float8_block_scale_shape, mxfp8_scale_shape
from .tensor._float8_block_quantizer import Float8BlockQuantizer
from .tensor._float8_blockwise_tensor_class import Float8BlockwiseQTensor
from .tensor.mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor
from .tensor.storage.float8_blockwise_tensor_storage import (
    Float8BlockwiseQTensorStorage,
    block_matrix_dims,
    columnwise_shape,
)
from .tensor.storage.mxfp8_tensor_storage import MXFP8TensorStorage
from .utils import ceil_div

__all__ = ["is_block_quantizer", "gathers_exactly", "cast_local_rows", "gather_block_cast"]


def is_block_quantizer(quantizer) -> bool:
    """Whether ``quantizer`` casts to block-scaled FP8 that :func:`gather_block_cast` gathers."""
    return isinstance(quantizer, (Float8BlockQuantizer, MXFP8Quantizer))


def _block_rows(quantizer, columnwise: bool) -> int:
    """How many rows (tokens) one block of a copy spans: 1 when every row is scaled alone."""
    if isinstance(quantizer, Float8BlockQuantizer):
        spans = columnwise or quantizer.block_scaling_dim == 2
        return quantizer.block_len if spans else 1
    spans = columnwise or quantizer.with_2d_quantization
    return quantizer.block_len if spans else 1


def gathers_exactly(quantizer, shape, *, rowwise: bool, columnwise: bool) -> bool:
    """Whether gathering every rank's cast of a tensor of ``shape`` (this rank's rows, every
    rank the same shape) along dimension 0 gives bitwise the cast of the gathered tensor, for
    the copies asked for: the blocks of those copies must not straddle two ranks' rows.

    A tensor of fewer than 2 dimensions is refused (its dimension 0 is the one the row-wise
    tiles run along), and so is an empty one.
    """
    shape = tuple(shape)
    if len(shape) < 2 or not is_block_quantizer(quantizer):
        return False
    rows, features = block_matrix_dims(shape)
    if rows == 0 or features == 0:
        return False
    wanted = [cw for cw, used in ((False, rowwise), (True, columnwise)) if used]
    return bool(wanted) and all(rows % _block_rows(quantizer, cw) == 0 for cw in wanted)


def cast_local_rows(quantizer, src: torch.Tensor, *, rowwise: bool, columnwise: bool):
    """This rank's rows cast by ``quantizer`` with the given copies, as internal storage. The
    quantizer's usages and ``internal`` flag are restored."""
    usages, internal = (quantizer.rowwise_usage, quantizer.columnwise_usage), quantizer.internal
    quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    quantizer.internal = True
    try:
        return quantizer.quantize_impl(src if src.is_contiguous() else src.contiguous())
    finally:
        quantizer.set_usage(rowwise=usages[0], columnwise=usages[1])
        quantizer.internal = internal


def _scale_layout(local, columnwise: bool, rows: int, features: int):
    """``((r, c), token_dim)``: the extent of a copy's scales without padding for a matrix of
    ``rows x features``, and which of their dimensions walks the tokens (rows)."""
    if isinstance(local, MXFP8TensorStorage):
        # Both copies keep the logical orientation: entry [row, block] / [block, column].
        if columnwise:
            return (ceil_div(rows, MXFP8Quantizer.block_len), features), 0
        return (rows, ceil_div(features, MXFP8Quantizer.block_len)), 0
    n = Float8BlockQuantizer.block_len
    if local._is_2D_scaled:
        if columnwise:  # [column block, row block]
            return (ceil_div(features, n), ceil_div(rows, n)), 1
        return (ceil_div(rows, n), ceil_div(features, n)), 0
    if columnwise:  # tiles of the transposed matrix: [row tile, column]
        return (ceil_div(rows, n), features), 0
    return (ceil_div(features, n), rows), 1  # already transposed: [column tile, row]


def _whole_scale_shape(local, shape, columnwise: bool) -> tuple[int, int]:
    if isinstance(local, MXFP8TensorStorage):
        return mxfp8_scale_shape(shape, columnwise)
    return float8_block_scale_shape(shape, 2 if local._is_2D_scaled else 1, columnwise)


def _gather_scales(local, columnwise, shape, whole_shape, world, group, all_gather):
    """One copy's scales of the whole tensor: every rank's unpadded scales gathered as bytes
    and placed at its rows' offset along the token dimension, the rest (padding) zero."""
    scale = local._columnwise_scale_inv if columnwise else local._rowwise_scale_inv
    rows, features = block_matrix_dims(shape)
    (r, c), token_dim = _scale_layout(local, columnwise, rows, features)
    piece = scale[:r, :c].contiguous()
    raw = piece.view(torch.uint8)  # float32 scales travel as their bytes
    out = torch.empty((world * raw.shape[0], raw.shape[1]), dtype=torch.uint8, device=raw.device)
    all_gather(out, raw, group=group, async_op=False)
    parts = out.view(piece.dtype).reshape(world, r, c)
    whole = torch.zeros(
        _whole_scale_shape(local, whole_shape, columnwise), dtype=piece.dtype, device=raw.device
    )
    if token_dim == 0:
        whole[: world * r, :c] = parts.reshape(world * r, c)
    else:
        whole[:r, : world * c] = parts.permute(1, 0, 2).reshape(r, world * c)
    return whole


def _gather_transposed(data, shape, whole_shape, world, group, all_gather):
    """Float8's column-wise bytes ``[K, M]``: every rank's ``[K, m]`` gathered, then its
    columns put at its rows' offset."""
    rows, features = block_matrix_dims(shape)
    src = data.reshape(features, rows).contiguous()
    out = torch.empty((world * features, rows), dtype=torch.uint8, device=data.device)
    all_gather(out, src, group=group, async_op=False)
    whole = out.view(world, features, rows).permute(1, 0, 2).reshape(features, world * rows)
    return whole.reshape(columnwise_shape(whole_shape))


def gather_block_cast(
    local, group, world: int, all_gather, *, internal: bool, async_op=False, output_tensor=None,
    copies: tuple[str, ...] = ("rowwise", "columnwise"),
):  # fmt: skip
    """All-gather along dimension 0 of ``local`` (this rank's rows cast by a block quantizer,
    internal storage, at least 2-D; :func:`gathers_exactly` holds for its copies):
    ``(result, handle)``, ``result`` holding those of ``copies`` that ``local`` holds, a
    quantized tensor (or storage with ``internal``) of the gathered shape and ``local``'s
    nominal dtype.

    Scales travel first, synchronously; the row-wise bytes then go straight into their final
    buffer (``output_tensor`` when given: ``uint8`` of the gathered shape), asynchronously
    with ``async_op`` when there is no column-wise copy (``handle``: wait before reading the
    bytes; else ``None``).
    """
    shape = tuple(local.size())
    whole_shape = (shape[0] * world, *shape[1:])
    device = local.device
    buffers = {}
    row = local._rowwise_data if "rowwise" in copies else None
    col = local._columnwise_data if "columnwise" in copies else None
    for name, columnwise, data in (("rowwise", False, row), ("columnwise", True, col)):
        if data is not None:
            buffers[f"{name}_scale_inv"] = _gather_scales(
                local, columnwise, shape, whole_shape, world, group, all_gather
            )
    if col is not None:
        if isinstance(local, MXFP8TensorStorage):  # logical orientation: rows concatenate
            out = torch.empty(whole_shape, dtype=torch.uint8, device=device)
            all_gather(out, col.contiguous(), group=group, async_op=False)
            buffers["columnwise_data"] = out
        else:
            buffers["columnwise_data"] = _gather_transposed(
                col, shape, whole_shape, world, group, all_gather
            )
    handle = None
    if row is not None:
        out = output_tensor
        if out is None:
            out = torch.empty(whole_shape, dtype=torch.uint8, device=device)
        elif tuple(out.shape) != whole_shape or out.dtype != torch.uint8:
            raise ValueError(
                f"gather_along_first_dim: output_tensor is {out.dtype} of shape "
                f"{tuple(out.shape)} but the block-scaled gather produces torch.uint8 bytes of "
                f"shape {whole_shape}; pass such a buffer or none"
            )
        asynchronous = async_op and col is None
        handle = all_gather(out, row.contiguous(), group=group, async_op=asynchronous)
        buffers["rowwise_data"] = out
    return _wrap(local, whole_shape, buffers, internal), handle


def _wrap(local, shape, buffers, internal: bool):
    """The gathered buffers as ``local``'s kind of storage (``internal``) or tensor."""
    if isinstance(local, MXFP8TensorStorage):
        if internal:
            return MXFP8TensorStorage(
                buffers.get("rowwise_data"), buffers.get("rowwise_scale_inv"),
                buffers.get("columnwise_data"), buffers.get("columnwise_scale_inv"),
                local._fp8_dtype, local._quantizer, fake_dtype=local._dtype,
            )  # fmt: skip
        return MXFP8Tensor(
            shape, local._dtype, fp8_dtype=local._fp8_dtype, quantizer=local._quantizer,
            **buffers,
        )  # fmt: skip
    if internal:
        return Float8BlockwiseQTensorStorage(
            buffers.get("rowwise_data"), buffers.get("rowwise_scale_inv"),
            buffers.get("columnwise_data"), buffers.get("columnwise_scale_inv"),
            local._fp8_dtype, local._quantizer, local._is_2D_scaled, fake_dtype=local._dtype,
        )  # fmt: skip
    return Float8BlockwiseQTensor(
        shape, local._dtype, fp8_dtype=local._fp8_dtype, quantizer=local._quantizer,
        is_2D_scaled=local._is_2D_scaled, **buffers,
    )  # fmt: skip
