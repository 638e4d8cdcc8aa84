"""Small rules the basic operations share: parameter dtype, compute dtype, and turning quantized
tensors back into plain ones. (Where operations build and materialize parameters is decided in
``device.py``.)"""

from __future__ import annotations

import torch

from ...quantized_tensor import QuantizedTensor, QuantizedTensorStorage

__all__ = [
    "quantize_weight_in_slot",
    "check_params_dtype",
    "activation_dtype",
    "plain",
    "autocast_dtype",
]

_PARAMS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_params_dtype(owner: str, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` (default ``torch.get_default_dtype()``), which must be FP32, FP16 or BF16."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in _PARAMS_DTYPES:
        raise TypeError(
            f"{owner}: dtype={dtype!r} is not supported; use torch.float32, torch.float16 or "
            "torch.bfloat16"
        )
    return dtype


def autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """``torch.autocast``'s dtype for ``tensor``'s device type, ``None`` outside autocast."""
    device_type = tensor.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def activation_dtype(input_: torch.Tensor, param: torch.Tensor) -> torch.dtype:
    """The dtype an operation with parameters computes in: ``torch.autocast``'s when it is on,
    else the parameter's (the input is cast to it)."""
    dtype = autocast_dtype(input_)
    return dtype if dtype is not None else param.dtype


def plain(tensor):
    """A quantized tensor dequantized to its nominal dtype; anything else unchanged."""
    if isinstance(tensor, (QuantizedTensor, QuantizedTensorStorage)):
        return tensor.dequantize()
    return tensor


def quantize_weight_in_slot(op, slot: int, values: torch.Tensor, old, device: torch.device):
    """``values`` as an FP8 weight quantized on ``device`` with ``op``'s forward quantizer
    ``slot`` (in place into ``old`` when that already is an FP8 weight). The op's recipe state is
    (re)created on ``device`` first when it is missing or lives elsewhere."""
    if op.get_quantizer("forward", slot) is None or op.recipe_state("forward").device != device:
        op.reset_recipe_state(recipe=op._quantized_weight_recipe, device=device)
    quantizer = op.get_quantizer("forward", slot).copy()
    quantizer.set_usage(rowwise=True, columnwise=True)
    quantizer.internal = False
    with torch.no_grad():
        if isinstance(old, QuantizedTensor) and not old.is_meta:
            old.quantize_(values)
            return old
        return quantizer.quantize_impl(values)
