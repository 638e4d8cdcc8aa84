"""Upstream's quantize family, ``quantizer`` objects first-class: each call hands the tensor to
the quantizer (:class:`~transformer_engine.pytorch.tensor.Float8Quantizer`,
:class:`~transformer_engine.pytorch.tensor.Float8CurrentScalingQuantizer`, or any other
:class:`~transformer_engine.pytorch.quantized_tensor.Quantizer`), which casts through the kernel
wrappers (native on CUDA, the reference elsewhere).

Unlike ``quantizer(tensor)``, these are not autograd functions: like upstream's C++ entry
points, they record nothing on the autograd tape.
"""

from __future__ import annotations

import torch

from transformer_engine.pytorch import cpp_extensions
from transformer_engine.pytorch.cpp_extensions.cast import column_sum
from transformer_engine.pytorch.quantized_tensor import (
    QuantizedTensor,
    QuantizedTensorStorage,
    Quantizer,
)

from ._dtype_args import high_precision_dtype, torch_dtype

__all__ = [
    "quantize",
    "dequantize",
    "bgrad_quantize",
    "create_empty_quantized_tensor",
    "multi_tensor_quantize",
    "split_quantize",
    "compute_amax",
    "fp8_transpose",
]


def _check_quantizer(op: str, quantizer, name: str = "quantizer") -> None:
    if not isinstance(quantizer, Quantizer):
        raise TypeError(
            f"{op}: {name} must be a transformer_engine.pytorch Quantizer (e.g. Float8Quantizer "
            f"or Float8CurrentScalingQuantizer), got {type(quantizer).__name__}"
        )


def _check_tensor(op: str, name: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")


def quantize(tensor: torch.Tensor, quantizer, output=None, noop=None):
    """Quantize ``tensor`` with ``quantizer``.

    Args:
        tensor: the high-precision tensor (a quantized one is dequantized first).
        quantizer: decides the format and the scale; a delayed-scaling ``Float8Quantizer``
            max-accumulates ``max|tensor|`` into its ``amax``.
        output: an existing quantized tensor to overwrite in place (and return); by default a
            new one is made (a ``*TensorStorage`` when ``quantizer.internal``).
        noop: one-element float32 tensor; when it holds 1.0 nothing is written (CUDA-graph
            weight caching). Without ``output`` the result is then a new, uninitialized tensor.
    """
    op = "quantize"
    _check_tensor(op, "tensor", tensor)
    _check_quantizer(op, quantizer)
    with torch.no_grad():
        if output is None and noop is None:
            return quantizer.quantize_impl(tensor)
        if output is None:
            output = quantizer.make_empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        elif not isinstance(output, QuantizedTensorStorage):
            raise TypeError(
                f"{op}: output must be a quantized tensor made by a quantizer, got "
                f"{type(output).__name__}; pass output=None to get a new one"
            )
        return quantizer.update_quantized(tensor, output, noop_flag=noop)


def dequantize(input, otype) -> torch.Tensor:
    """The values of the quantized tensor ``input`` as a plain tensor of type ``otype`` (a
    ``DType``: kFloat32, kFloat16 or kBFloat16)."""
    op = "dequantize"
    dtype = high_precision_dtype(op, "otype", otype)
    if not isinstance(input, (QuantizedTensor, QuantizedTensorStorage)):
        raise TypeError(
            f"{op}: input must be a quantized tensor (e.g. Float8Tensor), got "
            f"{type(input).__name__}; a plain tensor needs no dequantization"
        )
    with torch.no_grad():
        return input.dequantize(dtype=dtype)


def bgrad_quantize(input: torch.Tensor, quantizer):
    """``[grad_bias, quantized]``: ``input`` (an output gradient) summed over every dimension
    but the last (accumulated in float32, rounded once to ``input``'s dtype), and ``input``
    quantized with ``quantizer``. Per-tensor FP8 quantizers do both in one pass over
    ``input`` where the transposed copy is made."""
    op = "bgrad_quantize"
    _check_tensor(op, "input", input)
    _check_quantizer(op, quantizer)
    with torch.no_grad():
        if hasattr(quantizer, "quantize_with_dbias_impl"):
            quantized, grad_bias = quantizer.quantize_with_dbias_impl(input)
        else:
            quantized, grad_bias = quantizer.quantize_impl(input), column_sum(input)
    return [grad_bias, quantized]


def create_empty_quantized_tensor(
    quantizer, shape, dtype: torch.dtype, device=None, pin_memory: bool = False
):
    """An uninitialized quantized tensor of logical ``shape`` and nominal torch ``dtype``.

    ``device=None`` takes the device of the quantizer's state (a delayed-scaling quantizer's
    ``scale``); a stateless quantizer needs ``device``.
    """
    _check_quantizer("create_empty_quantized_tensor", quantizer)
    return quantizer.make_empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)


def multi_tensor_quantize(tensor_list, quantizer_list) -> list:
    """``[quantize(t, q) for t, q in zip(tensor_list, quantizer_list)]``; the lists must have
    the same length."""
    op = "multi_tensor_quantize"
    tensors, quantizers = list(tensor_list), list(quantizer_list)
    if len(tensors) != len(quantizers):
        raise ValueError(
            f"{op}: got {len(tensors)} tensors but {len(quantizers)} quantizers; pass one "
            "quantizer per tensor"
        )
    for i, (tensor, quantizer) in enumerate(zip(tensors, quantizers)):
        _check_tensor(op, f"tensor_list[{i}]", tensor)
        _check_quantizer(op, quantizer, f"quantizer_list[{i}]")
    return [quantize(t, q) for t, q in zip(tensors, quantizers)]


def split_quantize(tensor, split_sections, quantizer_list) -> list:
    """``tensor`` split along dim 0 into ``split_sections`` rows each (a grouped GEMM's inputs),
    each part quantized with its quantizer: ``[quantize(part, q), ...]``. The sections must be
    non-negative ints summing to ``tensor.shape[0]``, one quantizer per section."""
    op = "split_quantize"
    _check_tensor(op, "tensor", tensor)
    sections, quantizers = [int(n) for n in split_sections], list(quantizer_list)
    if len(sections) != len(quantizers):
        raise ValueError(
            f"{op}: got {len(sections)} split sections but {len(quantizers)} quantizers; pass "
            "one quantizer per section"
        )
    rows = tensor.shape[0] if tensor.dim() > 0 else 0
    if any(n < 0 for n in sections) or sum(sections) != rows:
        raise ValueError(
            f"{op}: split_sections={sections} must be non-negative and sum to the tensor's "
            f"{rows} rows (dim 0 of shape {tuple(tensor.shape)})"
        )
    for i, quantizer in enumerate(quantizers):
        _check_quantizer(op, quantizer, f"quantizer_list[{i}]")
    return [quantize(part, q) for part, q in zip(torch.split(tensor, sections), quantizers)]


def compute_amax(input: torch.Tensor, amax: torch.Tensor) -> None:
    """Overwrite the one-element float32 ``amax`` with ``max|input|`` (NaN ignored)."""
    cpp_extensions.compute_amax(input, out=amax)


def fp8_transpose(input: torch.Tensor, dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The transposed copy of FP8 data, as the casts write it for GEMMs that read K innermost:
    ``input`` (the bytes: ``uint8`` or a torch FP8 dtype, shape ``[..., N]``, read as
    ``[M, N]`` with ``M`` the product of the leading dims) becomes ``[N, M]``, into ``out``
    when given (same element size, that shape). ``dtype``: the FP8 ``DType`` of the bytes
    (kFloat8E4M3 or kFloat8E5M2); the bytes are moved, not converted."""
    op = "fp8_transpose"
    fp8 = torch_dtype(op, "dtype", dtype)
    if fp8 not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{op}: dtype={dtype!r} is not an FP8 type; use DType.kFloat8E4M3 or E5M2")
    _check_tensor(op, "input", input)
    if input.dtype not in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{op}: input has dtype {input.dtype}; pass the FP8 bytes (uint8 or FP8)")
    if input.dim() < 2:
        raise ValueError(f"{op}: input has shape {tuple(input.shape)}; it needs 2 or more dims")
    transposed = input.reshape(-1, input.shape[-1]).t()
    if out is None:
        return transposed.contiguous()
    if tuple(out.shape) != tuple(transposed.shape) or out.element_size() != 1:
        raise ValueError(
            f"{op}: out has shape {tuple(out.shape)} and dtype {out.dtype}; expected "
            f"{tuple(transposed.shape)} with one-byte elements"
        )
    if out.device != input.device:
        raise ValueError(f"{op}: out is on {out.device} but input is on {input.device}")
    return out.copy_(transposed.view(out.dtype) if transposed.dtype != out.dtype else transposed)
