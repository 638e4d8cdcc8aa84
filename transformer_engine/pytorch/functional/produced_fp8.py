"""FP8 tensors that a producer (an activation or a norm) writes for the linear next to it.

The per-tensor FP8 quantizers (delayed and current scaling) have ``quantize_produced``: the
producer's kernel gets the scale (delayed scaling: the quantizer's own, with its amax buffer;
current scaling: from an amax-only pass of the producer first) and writes the FP8 bytes and the
transposed copy in its own pass. Used by ``te.LayerNormMLP`` (``module/_mlp_function.py``: FC2's
input, FC1's output gradient) and by the te.ops fusions of an activation or a norm with the next
linear's input cast (``ops/fused/``).
"""

from __future__ import annotations

import torch

__all__ = ["can_produce", "cast_for_linear", "produce_fp8", "per_tensor_fp8_recipe"]


def per_tensor_fp8_recipe(recipe) -> bool:
    """Whether ``recipe`` is delayed or current scaling without a high-precision backward: the
    recipes whose quantizers take a produced tensor (the fusion functions' condition)."""
    return (
        recipe is not None
        and recipe.float8_per_tensor_scaling()
        and getattr(recipe, "backward_override", None) is None
    )


def can_produce(quantizer, dtype: torch.dtype, nominal_dtype: torch.dtype) -> bool:
    """Whether a producer computing in ``dtype`` may write ``quantizer``'s FP8 tensor of nominal
    ``nominal_dtype`` itself: the quantizer takes produced tensors and no dtype conversion sits
    between the producer and the cast (the unfused chain would round to ``nominal_dtype``
    first)."""
    return (
        quantizer is not None
        and getattr(quantizer, "quantize_produced", None) is not None
        and (
            getattr(quantizer, "scale_precedes_cast", False)
            or hasattr(quantizer, "_scale_from_amax_pass")
        )
        and dtype == nominal_dtype
    )


def produce_fp8(quantizer, produce, amax_of, shape, dtype, device, *, rowwise, columnwise):
    """``quantizer.quantize_produced(produce, ...)`` as internal storage with the given
    usages (left set, as the linear core's own casts leave them; ``internal`` is restored):
    ``(storage, extra)`` with ``extra`` what ``produce`` returned beside the cast."""
    quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    internal, quantizer.internal = quantizer.internal, True
    try:
        return quantizer.quantize_produced(produce, shape, dtype, device, amax_of=amax_of)
    finally:
        quantizer.internal = internal


def cast_for_linear(quantizer, tensor: torch.Tensor, *, rowwise: bool, columnwise: bool):
    """``tensor`` cast with ``quantizer`` as internal storage with the given usages: the cast
    the linear core would run on it (``internal`` is restored, the usages stay set)."""
    quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    internal, quantizer.internal = quantizer.internal, True
    try:
        return quantizer.quantize_impl(tensor)
    finally:
        quantizer.internal = internal
