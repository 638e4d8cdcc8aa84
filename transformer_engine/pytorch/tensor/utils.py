"""Helpers on quantized tensors at upstream's path ``transformer_engine.pytorch.tensor.utils``."""

from __future__ import annotations

import torch

from ..device import DevicePlacementError
from ._master_weights import (
    cast_master_weights_to_fp8,
    post_all_gather_processing,
    quantize_master_weights,
)
from .storage.float8_tensor_storage import Float8TensorStorage

__all__ = [
    "replace_raw_data",
    "quantize_master_weights",
    "cast_master_weights_to_fp8",
    "post_all_gather_processing",
]


def replace_raw_data(tensor, new_raw_data: torch.Tensor) -> None:
    """Move a quantized tensor's raw FP8 bytes into ``new_raw_data``, keeping its values.

    The bytes are copied into ``new_raw_data``, which then *is* the tensor's row-wise buffer;
    nothing else (scale, transpose, shape, dtype) changes. Used to pack many FP8 parameters
    into one contiguous allocation (e.g. a ZeRO bucket): pass a view of the bucket. The tensor
    stays a whole tensor with its own scale: in-place updates and ``copy_`` re-quantize it with
    its quantizer's scale and write the new bytes into the bucket in place.

    Parameters
    ----------
    tensor : Float8Tensor or Float8TensorStorage
        Must hold its row-wise bytes (``_data``).
    new_raw_data : torch.Tensor
        ``torch.uint8``, the same shape as the current bytes, on the same device.

    Raises
    ------
    TypeError
        ``tensor`` is not a per-tensor-scaled FP8 tensor, or ``new_raw_data`` is not uint8.
    ValueError
        ``tensor`` holds only its transposed copy, or the shapes differ.
    DevicePlacementError
        ``new_raw_data`` is on another device than the bytes it replaces.
    """
    if not isinstance(tensor, Float8TensorStorage):
        raise TypeError(
            f"replace_raw_data: a {type(tensor).__name__} has no FP8 raw data buffer here; only "
            f"Float8Tensor / Float8TensorStorage (per-tensor scaling) are supported"
        )
    old = tensor._data
    if old is None:
        raise ValueError(
            "replace_raw_data: the tensor holds only its column-wise (transposed) bytes, no "
            "row-wise buffer to replace; call update_usage(rowwise_usage=True) first"
        )
    if not isinstance(new_raw_data, torch.Tensor) or new_raw_data.dtype != old.dtype:
        got = new_raw_data.dtype if isinstance(new_raw_data, torch.Tensor) else type(new_raw_data)
        raise TypeError(f"replace_raw_data: new_raw_data must be a {old.dtype} tensor, got {got}")
    if new_raw_data.shape != old.shape:
        raise ValueError(
            f"replace_raw_data: new_raw_data has shape {tuple(new_raw_data.shape)}, the raw data "
            f"has {tuple(old.shape)}; pass a view of that shape (e.g. bucket[a:b].view(shape))"
        )
    if new_raw_data.device != old.device:
        raise DevicePlacementError(
            f"replace_raw_data: new_raw_data is on {new_raw_data.device} but the tensor's data "
            f"and scale live on {old.device}; allocate the new buffer on {old.device}"
        )
    # detach(): the buffer may be a view of a parameter bucket that records autograd history.
    new_raw_data.detach().copy_(old)
    # The GEMM operand cache notices a replaced buffer by identity, so no view goes stale.
    tensor._data = new_raw_data


# What a quantized tensor keeps in its ``__dict__``: its buffers and their bookkeeping (a
# module replacing such a parameter carries over the caller's attributes, not these).
QUANTIZED_TENSOR_ATTRIBUTES = frozenset(("_data", "_transpose", "_transpose_invalid",
    "_scale_inv", "_fp8_dtype", "_quantizer", "_dtype", "_shares_scale_with_base",
    "_data_fp8_view", "_transpose_fp8_view", "_rowwise_data", "_rowwise_scale_inv",
    "_columnwise_data", "_columnwise_scale_inv", "_amax_rowwise", "_amax_columnwise",
    "_columnwise_rht", "_rht_random_sign_mask", "_logical_shape", "_with_gemm_swizzled_scales",
    "_fp4_dtype"))  # fmt: skip


def attach_high_precision_init_val(param: torch.nn.Parameter, values: torch.Tensor) -> None:
    """Upstream's ``preserve_high_precision_init_val`` on a quantized weight: ``values`` (a CPU
    copy of the weight before quantization) as ``param._high_precision_init_val``, with
    ``param.get_high_precision_init_val()`` returning it and
    ``param.clear_high_precision_init_val()`` dropping it (``get`` then returns ``None`` and the
    copy can be freed). Both read the attribute when called, so nothing else holds the copy."""
    param._high_precision_init_val = values

    def get_high_precision_init_val():
        return getattr(param, "_high_precision_init_val", None)

    def clear_high_precision_init_val():
        param._high_precision_init_val = None

    param.get_high_precision_init_val = get_high_precision_init_val
    param.clear_high_precision_init_val = clear_high_precision_init_val
