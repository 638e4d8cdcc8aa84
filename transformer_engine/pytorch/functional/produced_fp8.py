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

from ..cpp_extensions.activation import (
    activation_amax,
    activation_backward_amax,
    activation_backward_fp8,
    activation_forward_fp8,
)

__all__ = [
    "can_produce",
    "cast_for_linear",
    "produce_fp8",
    "per_tensor_fp8_recipe",
    "activation_producer",
    "activation_gradient_producer",
]


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


# The producers of an activation (its output as the next linear's input) and of its gradient
# (as the previous linear's grad output): ``(produce, amax_of)`` for :func:`produce_fp8`. On
# the CPU the amax pass returns the float32 values it computed and the cast takes them (current
# scaling computes the activation once); on CUDA each pass is its own kernel and keeps nothing.


def activation_producer(x2: torch.Tensor, spec):
    """``(produce, amax_of)`` writing ``act(x2)`` (2-D) in FP8."""
    kept = []

    def amax_of(amax):  # current scaling's first pass
        kept[:] = [activation_amax(x2, spec, amax)]

    def produce(scale, amax, fp8_dtype, with_transpose):
        values = kept.pop() if kept else None
        res = activation_forward_fp8(
            x2, spec, scale, fp8_dtype, amax=amax, with_transpose=with_transpose, values=values
        )
        return res, None

    return produce, amax_of


def activation_gradient_producer(grad2: torch.Tensor, x2: torch.Tensor, spec, with_dbias: bool):
    """``(produce, amax_of)`` writing the activation's input gradient (2-D) in FP8, with the
    previous layer's bias gradient as ``produce``'s extra result when ``with_dbias``."""
    kept = []

    def amax_of(amax):  # current scaling's first pass
        kept[:] = [activation_backward_amax(grad2, x2, spec, amax)]

    def produce(scale, amax, fp8_dtype, with_transpose):
        values = kept.pop() if kept else None
        return activation_backward_fp8(
            grad2, x2, spec, scale, fp8_dtype, amax=amax, with_dbias=with_dbias, values=values
        )

    return produce, amax_of
