"""Quantizing into existing per-tensor FP8 buffers, and the layout rule every FP8 cast follows.

Two callers write new values into a ``Float8Tensor``'s (or ``Float8TensorStorage``'s) own
buffers: a quantizer's ``update_quantized``, and ``Float8Tensor.quantize_`` for a tensor
that has no quantizer (one loaded from a checkpoint keeps its current scale). Both run
:func:`quantize_into`; it lives below the quantizer classes and the tensor class so that
neither has to import the other for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import cpp_extensions as ext
from ..constants import HIGH_PRECISION_DTYPES, DType
from ..device import is_non_tn_fp8_gemm_supported
from ..quantized_tensor import QuantizedTensor, QuantizedTensorStorage
from .storage.float8_tensor_storage import Float8TensorStorage

__all__ = ["check_data_value", "float8_layouts", "high_precision_source", "quantize_into"]

# ``scale_and_amax(src) -> (scale, amax buffer or None)``: the scale to cast ``src`` with (a
# one-element float32 tensor on its device) and where the cast max-accumulates its amax.
ScaleAndAmax = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor | None]"]


def high_precision_source(tensor) -> torch.Tensor:
    """A plain tensor to quantize: quantized inputs are dequantized first."""
    if isinstance(tensor, QuantizedTensor):
        return tensor._dequantize_plain()
    if isinstance(tensor, QuantizedTensorStorage):
        return tensor.dequantize()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor to quantize, got {type(tensor).__name__}")
    # Quantizing is never differentiated through; detach only where autograd could record
    # (inside autograd functions grad mode is off, and the detach would be a wasted dispatch).
    if tensor.requires_grad and torch.is_grad_enabled():
        return tensor.detach()
    return tensor


def check_data_value(owner: str, value, shape) -> None:
    """What a quantized tensor's ``.data = value`` setter quantizes into its own buffers must be
    a tensor of the same shape (``quantize_`` would try to broadcast another shape, and torch's
    expand error named neither shape)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{owner}.data must be set to a tensor, got {type(value)}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"{owner}.data: a tensor of shape {tuple(value.shape)} cannot be quantized into "
            f"shape {tuple(shape)}; assign a tensor of shape {tuple(shape)}"
        )


def float8_layouts(
    owner: str, rowwise: bool, columnwise: bool, device: torch.device, shape
) -> tuple[bool, bool]:
    """``(need_data, need_transpose)`` for the requested usages of a tensor on ``device``.

    Devices whose FP8 GEMMs take non-TN layouts serve column-wise usage from the row-wise
    bytes, so they never keep a transposed copy. Elsewhere (Hopper, Ada, CPU) column-wise
    usage means a transposed copy, for every shape: upstream's cast writes a 0-d tensor's
    transpose as a 0-d copy of its byte, and so does :func:`cast_with_layouts`.
    """
    if not rowwise and not columnwise:
        raise ValueError(
            f"{owner}: rowwise and columnwise usage are both False, so nothing would be "
            "produced; call set_usage(rowwise=True) and/or set_usage(columnwise=True)"
        )
    non_tn = is_non_tn_fp8_gemm_supported(device)
    need_data = rowwise or (columnwise and non_tn)
    need_transpose = columnwise and not non_tn
    return need_data, need_transpose


def cast_transpose_of_0d(data: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The column-wise bytes of a 0-d FP8 cast: its one byte (the cast kernels take no 0-d
    transpose; a one-element tensor is its own transpose, so the copy is exact)."""
    if out is None:
        return data.clone()
    return out.copy_(data)


def quantize_into(
    owner: str,
    src: torch.Tensor,
    dst: Float8TensorStorage,
    *,
    fp8_dtype: DType,
    rowwise: bool,
    columnwise: bool,
    scale_and_amax: ScaleAndAmax,
    noop_flag: torch.Tensor | None = None,
) -> Float8TensorStorage:
    """Quantize ``src`` into ``dst``'s buffers in place and return ``dst``.

    ``src`` is moved to ``dst``'s device first (``copy_`` semantics). ``dst``'s layouts
    become those of the ``rowwise``/``columnwise`` usages (:func:`float8_layouts`). When
    ``dst`` is what the dispatch made of part of a larger FP8 tensor (marked
    ``_shares_scale_with_base``: a dim-0 slice, a partial ``as_strided``), it keeps the scale
    it shares with that tensor (``1 / dst._scale_inv``) so the rest stays valid, and a strided
    view's bytes are written through. Any other ``dst`` is a whole tensor with its own scale,
    also when its bytes live in a bigger buffer (``replace_raw_data``). Buffers written in
    place stay the very same objects (callers may hold them). ``owner`` names the caller in
    error messages.
    """
    if not isinstance(dst, Float8TensorStorage):
        raise TypeError(
            f"{owner}.update_quantized: dst must be a Float8Tensor or Float8TensorStorage, "
            f"got {type(dst).__name__}"
        )
    src = high_precision_source(src)
    shape = dst.size()
    if tuple(src.shape) != tuple(shape):
        raise ValueError(
            f"{owner}.update_quantized: src has shape {tuple(src.shape)} but dst has "
            f"{tuple(shape)}; pass a tensor of dst's shape"
        )
    if dst.device.type == "meta":
        return dst  # nothing to write
    if src.dtype not in HIGH_PRECISION_DTYPES:
        src = src.to(dst._dtype)
    if src.device != dst.device:
        src = src.to(dst.device)
    need_data, need_transpose = float8_layouts(owner, rowwise, columnwise, dst.device, shape)
    partial = dst._shares_scale_with_base
    if partial:
        if DType.cast(dst._fp8_dtype) != fp8_dtype:
            raise ValueError(
                f"{owner}.update_quantized: dst is part of a larger {dst._fp8_dtype.name} "
                f"tensor and cannot be rewritten as {fp8_dtype.name}"
            )
        need_data, need_transpose = True, False
    scale, amax = scale_and_amax(src)
    if partial:
        scale = torch.reciprocal(dst._scale_inv.detach().reshape(1))

    def reusable(buf):
        return buf is not None and buf.is_contiguous()

    out = dst._data if need_data and reusable(dst._data) else None
    out_t = dst._transpose if need_transpose and reusable(dst._transpose) else None
    zero_dim = len(shape) == 0  # the kernels write no 0-d transpose: copy the byte instead
    if zero_dim and not need_data:
        out = out_t  # a 0-d transpose has the data's shape: the cast writes it directly
    res = ext.quantize(
        src,
        scale,
        fp8_dtype,
        amax=amax,
        scale_inv=None if partial else dst._scale_inv,
        out=out,
        with_transpose=need_transpose and not zero_dim,
        out_transpose=None if zero_dim else out_t,
        noop_flag=noop_flag,
    )
    written = out if out is not None else res.data.view(torch.uint8)
    if partial and noop_flag is None and dst._data is not None and written is not dst._data:
        written = dst._data.copy_(written)  # a strided view: the larger tensor's bytes
    data = written if need_data else None
    transpose = None
    if need_transpose and zero_dim:
        transpose = written if not need_data else cast_transpose_of_0d(written, out_t)
    elif need_transpose:
        transpose = out_t if out_t is not None else res.transpose.view(torch.uint8)
    dst._replace_buffers(data=data, transpose=transpose, fp8_dtype=fp8_dtype)
    return dst
