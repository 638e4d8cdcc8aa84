"""Aten operations that a ``Float8Tensor`` performs on its FP8 bytes.

``FLOAT8_HANDLERS`` maps an aten overload to ``handler(func, args, kwargs)``. A
handler returns the result, or ``NotImplemented`` to fall back to the generic
rules of :class:`~transformer_engine.pytorch.quantized_tensor.QuantizedTensor`
(re-quantize for in-place ops, dequantize otherwise).

Every operation here is exact: per-tensor scaling makes views, slices and
transposes of the bytes the views, slices and transposes of the values.
Results that are views share the row-wise bytes and ``_scale_inv`` with their
source. A transposed copy is kept where it is still a view of the source's
transpose; slices along dim 0 (``t[a:b]``, ``narrow``, ``split``, ``t[i]``, and an
``as_strided`` row shard) keep the matching columns of the source's transpose as a
new contiguous copy (the GEMM reads a dense transposed copy); other results drop it
(``_transpose is None``).

A result that holds part of its source's bytes (a slice, a partial
``as_strided``) or a copy of them (``t()`` of a row-wise-only tensor) while sharing
its ``_scale_inv`` is marked ``_shares_scale_with_base``: re-quantizing it keeps
that scale and ``copy_`` into it re-quantizes instead of copying a scale, so the
rest of the source stays valid. Views of a marked tensor stay marked.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .. import cpp_extensions as ext
from ..constants import HIGH_PRECISION_DTYPES
from .storage.float8_tensor_storage import (
    Float8TensorStorage,
    float8_transposed_shape,
    transpose_bytes,
    untranspose_bytes,
)

__all__ = ["FLOAT8_HANDLERS"]

aten = torch.ops.aten

FLOAT8_HANDLERS: dict[torch._ops.OpOverload, Callable] = {}


def _implements(*ops):
    def register(fn):
        for op in ops:
            FLOAT8_HANDLERS[op] = fn
        return fn

    return register


def _is_float8(t) -> bool:
    return isinstance(t, Float8TensorStorage) and isinstance(t, torch.Tensor)


def _rebuild(src, *, shape, data, transpose, scale_inv=None, dtype=None, part=False):
    """A tensor of ``src``'s class with new buffers (quantizer and FP8 format kept).

    It shares ``src``'s scale unless ``scale_inv`` is given, and is marked
    ``_shares_scale_with_base`` when it shares it and is ``part`` of ``src`` (or a copy of its
    bytes), or ``src`` is marked."""
    out = type(src)(
        shape,
        dtype or src.dtype,
        data=data,
        fp8_scale_inv=src._scale_inv if scale_inv is None else scale_inv,
        fp8_dtype=src._fp8_dtype,
        data_transpose=transpose,
        quantizer=src._quantizer,
    )
    if scale_inv is None and (part or src._shares_scale_with_base):
        out._shares_scale_with_base = True
    return out


def _normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


# ---------------------------------------------------------------------- aliases and views


@_implements(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    t = args[0]
    return _rebuild(t, shape=t.shape, data=t._data, transpose=t._transpose)


def _view_shape(shape, size) -> torch.Size:
    """The concrete shape ``size`` (may hold one -1) denotes for a tensor of ``shape``."""
    return torch.empty(shape, device="meta").view(size).shape


@_implements(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, args, kwargs):
    t, size = args[0], args[1]
    new_shape = _view_shape(t.shape, size)
    same_last = len(new_shape) > 0 and t.dim() > 0 and new_shape[-1] == t.shape[-1]
    if t._data is None and not same_last:
        return NotImplemented  # the transpose alone cannot be re-laid out
    if t._data is not None and not t._data.is_contiguous():
        return NotImplemented  # bytes of a strided as_strided view: no view of them fits
    data = t._data.view(new_shape) if t._data is not None else None
    transpose = None
    if t._transpose is not None and same_last:
        # Leading dimensions are flattened row-major in both layouts: still a view.
        transpose = t._transpose.view(ext.transposed_shape(new_shape))
    return _rebuild(t, shape=new_shape, data=data, transpose=transpose)


@_implements(aten.t.default, aten.transpose.int, aten.permute.default)
def _transpose(func, args, kwargs):
    t = args[0]
    if func is aten.permute.default:
        dims = [_normalize_dim(d, max(t.dim(), 1)) for d in args[1]]
        if dims == list(range(t.dim())):
            return _detach(func, args, kwargs)
        if dims != [1, 0]:
            return NotImplemented
    elif func is aten.transpose.int:
        d0 = _normalize_dim(args[1], max(t.dim(), 1))
        d1 = _normalize_dim(args[2], max(t.dim(), 1))
        if d0 == d1:
            return _detach(func, args, kwargs)
        if t.dim() != 2:
            return NotImplemented
    elif t.dim() < 2:
        return _detach(func, args, kwargs)
    rows, cols = t.shape
    if t._data is not None and t._transpose is not None:
        # The two layouts of the transpose are the two layouts of the source, swapped.
        data, transpose = t._transpose, t._data
    elif t._data is not None:
        # a copy of the bytes, sharing the scale: writing it must not rescale the source
        copied = transpose_bytes(t._data)
        return _rebuild(t, shape=(cols, rows), data=copied, transpose=None, part=True)
    else:
        data, transpose = t._transpose, None
    return _rebuild(t, shape=(cols, rows), data=data, transpose=transpose)


@_implements(aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _reshaping_view(func, args, kwargs):
    t = args[0]
    shape = func(torch.empty(t.shape, device="meta"), *args[1:], **kwargs).shape
    return _view(aten.view.default, (t, shape), {})


def _dim0_of_transpose(t) -> int:
    """Where the source's dim 0 sits in its transposed copy ``(last, *leading)``: dim 1, or
    dim 0 for a 1-D tensor (whose transposed copy has its own layout)."""
    return 0 if t.dim() == 1 else 1


def _dim0_slices(t, take):
    """``(shapes, data parts, transpose parts)`` of a dim-0 slicing op, ``take(buffer, dim)``
    applied to each layout the source holds (``None`` for a layout it lacks). Transpose parts
    are made contiguous: a dim-0 slice is a column slice of the transposed copy."""
    shapes = take(torch.empty(t.shape, device="meta"), 0)
    data = take(t._data, 0) if t._data is not None else None
    transpose = None
    if t._transpose is not None:
        transpose = take(t._transpose, _dim0_of_transpose(t))
        transpose = (
            [part.contiguous() for part in transpose]
            if isinstance(transpose, (list, tuple))
            else transpose.contiguous()
        )
    return shapes, data, transpose


def _along_dim0(t, dim) -> bool:
    return t.dim() > 0 and _normalize_dim(dim, t.dim()) == 0


@_implements(aten.split.Tensor, aten.split_with_sizes.default)
def _split(func, args, kwargs):
    t = args[0]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if not _along_dim0(t, dim):
        return NotImplemented
    shapes, data, transpose = _dim0_slices(t, lambda buf, d: func(buf, args[1], d))
    return [
        _rebuild(
            t,
            shape=shape.shape,
            data=None if data is None else data[i],
            transpose=None if transpose is None else transpose[i],
            part=shape.numel() < t.numel(),
        )
        for i, shape in enumerate(shapes)
    ]


@_implements(aten.slice.Tensor)
def _slice(func, args, kwargs):
    t = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    if not _along_dim0(t, dim) or step != 1:
        return NotImplemented
    rest = {k: v for k, v in kwargs.items() if k != "dim"}
    shape, data, transpose = _dim0_slices(t, lambda buf, d: func(buf, d, *args[2:], **rest))
    part = shape.numel() < t.numel()
    return _rebuild(t, shape=shape.shape, data=data, transpose=transpose, part=part)


@_implements(aten.select.int)
def _select(func, args, kwargs):
    t, dim = args[0], args[1]
    if not _along_dim0(t, dim):
        return NotImplemented
    shape, data, transpose = _dim0_slices(t, lambda buf, d: func(buf, d, *args[2:], **kwargs))
    part = shape.numel() < t.numel()
    return _rebuild(t, shape=shape.shape, data=data, transpose=transpose, part=part)


def _row_shard(t, size, stride, offset) -> tuple[int, int] | None:
    """``(first row, row count)`` when ``as_strided(size, stride, offset)`` of the contiguous
    ``t`` is the dim-0 slice ``t[first:first + count]``, else ``None``."""
    if t.dim() == 0 or len(size) != t.dim() or tuple(size[1:]) != tuple(t.shape[1:]):
        return None
    row = math.prod(t.shape[1:])
    expected = [math.prod(size[i + 1 :]) for i in range(len(size))]
    # torch ignores the stride of a dimension of size 1 (is_contiguous does too)
    if any(n != 1 and s != e for n, s, e in zip(size, stride, expected)):
        return None
    if row == 0 or offset % row or offset // row + size[0] > t.shape[0]:
        return None
    return offset // row, size[0]


@_implements(aten.as_strided.default)
def _as_strided(func, args, kwargs):
    t, size, stride = args[0], list(args[1]), list(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    offset = 0 if offset is None else int(offset)
    shard = _row_shard(t, size, stride, offset)
    if shard is not None:
        # the matching columns of the transposed copy are kept, as for t[a:b]
        first, count = shard
        meta, data, transpose = _dim0_slices(t, lambda buf, d: buf.narrow(d, first, count))
        part = meta.numel() < t.numel()
        return _rebuild(t, shape=meta.shape, data=data, transpose=transpose, part=part)
    if not size and offset == 0 and t.dim() == 0:
        return _detach(func, args, kwargs)
    if t._data is None or not t._data.is_contiguous() or min(stride, default=0) < 0:
        return NotImplemented  # the transpose alone cannot be re-strided: high precision
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if offset > t.numel() or (math.prod(size) > 0 and last >= t.numel()):
        return NotImplemented  # past this tensor's bytes: torch's error, in high precision
    data = t._data.as_strided(size, stride, t._data.storage_offset() + offset)
    return _rebuild(t, shape=torch.Size(size), data=data, transpose=None, part=True)


# ---------------------------------------------------------------------- copies


@_implements(aten.clone.default)
def _clone(func, args, kwargs):
    t = args[0]

    def clone(buf):
        return None if buf is None else buf.clone()

    return _rebuild(
        t,
        shape=t.shape,
        data=clone(t._data),
        transpose=clone(t._transpose),
        scale_inv=t._scale_inv.clone(),
    )


@_implements(aten.copy_.default)
def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if not (_is_float8(dst) and _is_float8(src)) or dst.shape != src.shape:
        return NotImplemented
    if dst.is_meta or src.is_meta:
        return NotImplemented
    if dst._shares_scale_with_base:
        # dst shares its scale with a larger tensor: re-quantize with that scale instead.
        return NotImplemented
    # Raw bytes and scale: the layouts dst holds are filled from whatever src holds.
    if dst._data is not None:
        dst._data.copy_(src._data if src._data is not None else untranspose_bytes(src._transpose))
    if dst._transpose is not None:
        dst._transpose.copy_(
            src._transpose if src._transpose is not None else transpose_bytes(src._data)
        )
    dst._scale_inv.copy_(src._scale_inv.reshape(dst._scale_inv.shape))
    dst._fp8_dtype = src._fp8_dtype
    return dst


# ---------------------------------------------------------------------- new tensors


@_implements(aten.empty_like.default, aten.new_empty.default, aten.new_zeros.default)
def _new_like(func, args, kwargs):
    t = args[0]
    shape = t.shape if func is aten.empty_like.default else torch.Size(args[1])
    dtype = kwargs.get("dtype") or t.dtype
    if dtype not in HIGH_PRECISION_DTYPES:
        return NotImplemented
    device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else t.device
    pin = bool(kwargs.get("pin_memory"))
    alloc = torch.zeros if func is aten.new_zeros.default else torch.empty
    kw = {"dtype": torch.uint8, "device": device, "pin_memory": pin}
    # Same layouts as the source.
    want_transpose = t._transpose is not None
    want_data = t._data is not None or not want_transpose
    data = alloc(shape, **kw) if want_data else None
    transpose = alloc(float8_transposed_shape(shape), **kw) if want_transpose else None
    if t._scale_inv.is_meta and device.type != "meta":
        scale_inv = torch.ones(1, dtype=torch.float32, device=device)
    else:
        scale_inv = t._scale_inv.reshape(1).to(device, copy=True)
    return _rebuild(
        t, shape=shape, data=data, transpose=transpose, scale_inv=scale_inv, dtype=dtype
    )
