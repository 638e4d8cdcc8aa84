"""FP8 cast kernels: quantize (with amax and an optional transposed copy), dequantize, amax.

Each function validates its tensors, then runs the native kernel for CUDA
tensors (on ``tensor.device``, in that device's current stream) or the
reference math in :mod:`transformer_engine.pytorch.reference` otherwise.
Outputs may be passed in (``out=...``) to be filled; otherwise they are
allocated on the input's device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import reference
from ..constants import HIGH_PRECISION_DTYPES, to_torch_fp8_dtype
from ._routing import launch_args, native_for, tensor_arg
from ._validation import (
    check_dtype,
    check_fp32_scalar,
    check_output,
    check_tensor,
    check_tensors_on,
)
from .scaling import AMAX_WORKSPACE_ELEMENTS, current_scale_prevalidated, float32_scratch

__all__ = [
    "QuantizeResult",
    "quantize",
    "quantize_prevalidated",
    "quantize_dbias_prevalidated",
    "quantize_current_scaling_prevalidated",
    "column_sum",
    "DBIAS_TILE_ROWS",
    "dbias_workspace_elements",
    "dequantize",
    "compute_amax",
    "transposed_shape",
]


class QuantizeResult(NamedTuple):
    """What :func:`quantize` produced: FP8 data, its transposed copy (or ``None``), ``1/scale``."""

    data: torch.Tensor
    transpose: torch.Tensor | None
    scale_inv: torch.Tensor


def transposed_shape(shape) -> tuple:
    """Shape of the column-wise copy: ``(last, *leading)``."""
    if len(shape) == 0:
        raise ValueError("a 0-d tensor has no transposed copy; reshape it to 1-d first")
    return (shape[-1], *shape[:-1])


def _as_scale(op: str, scale, like: torch.Tensor) -> torch.Tensor:
    if isinstance(scale, (int, float)):
        return torch.tensor([float(scale)], dtype=torch.float32, device=like.device)
    check_fp32_scalar(op, "scale", scale)
    return scale


def quantize(
    input: torch.Tensor,
    scale: torch.Tensor | float,
    fp8_dtype,
    *,
    amax: torch.Tensor | None = None,
    scale_inv: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    with_transpose: bool = False,
    out_transpose: torch.Tensor | None = None,
    noop_flag: torch.Tensor | None = None,
) -> QuantizeResult:
    """Cast ``input * scale`` to FP8, saturating; optionally also write the transposed copy.

    Args:
        input: float32, float16 or bfloat16 tensor (made contiguous if it is not).
        scale: one-element float32 tensor on ``input``'s device, or a Python number.
        fp8_dtype: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` or the ``DType`` equivalent.
        amax: one-element float32 buffer; ``max |input|`` (unscaled) is max-accumulated into it.
        scale_inv: one-element float32 buffer that receives ``1 / scale``.
        out: FP8 (or uint8) buffer of ``input``'s shape.
        with_transpose: also produce the column-wise copy of shape ``(last, *leading)``.
        out_transpose: buffer for that copy (implies ``with_transpose``).
        noop_flag: one-element float32 tensor; when it holds 1.0 nothing is written at all.
    """
    op = "quantize"
    check_tensor(op, "input", input)
    check_dtype(op, "input", input, HIGH_PRECISION_DTYPES)
    dtype = to_torch_fp8_dtype(fp8_dtype)
    scale = _as_scale(op, scale, input)
    for name, t in (("amax", amax), ("scale_inv", scale_inv), ("noop_flag", noop_flag)):
        check_fp32_scalar(op, name, t)
    with_transpose = with_transpose or out_transpose is not None
    t_shape = transposed_shape(input.shape) if with_transpose else None
    check_output(op, "out", out, input.shape, (dtype, torch.uint8))
    check_output(op, "out_transpose", out_transpose, t_shape or (), (dtype, torch.uint8))
    check_tensors_on(
        op, "input", input, scale=scale, amax=amax, scale_inv=scale_inv, out=out,
        out_transpose=out_transpose, noop_flag=noop_flag,
    )  # fmt: skip

    input = input.contiguous()
    device = input.device
    if out is None:
        out = torch.empty(input.shape, dtype=dtype, device=device)
    if with_transpose and out_transpose is None:
        out_transpose = torch.empty(t_shape, dtype=dtype, device=device)
    if scale_inv is None:
        scale_inv = torch.empty(1, dtype=torch.float32, device=device)
    out_t_fp8 = out_transpose.view(dtype) if out_transpose is not None else None
    _run_quantize(input, scale, dtype, amax, scale_inv, out.view(dtype), out_t_fp8, noop_flag)
    return QuantizeResult(out, out_transpose, scale_inv)


def quantize_prevalidated(
    input: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax: torch.Tensor | None,
    with_transpose: bool,
    consume_input: bool = False,
) -> QuantizeResult:
    """:func:`quantize` for quantizers, whose ``scale`` and ``amax`` are their own state.

    The caller has checked the input's dtype and that ``fp8_dtype`` is a torch FP8 dtype; the
    one thing left to check is where the state lives relative to the input (one comparison
    each), so the per-call host cost stays small. ``consume_input``: the input is a float32
    temporary the caller gives up; the CPU cast scales it in place (garbage afterwards).
    """
    input, result = _prevalidated_outputs(input, scale, fp8_dtype, amax, with_transpose)
    _run_quantize(input, scale, fp8_dtype, amax, result.scale_inv, result.data, result.transpose,
                  None, consume_input=consume_input)  # fmt: skip
    return result


def _prevalidated_outputs(input, scale, fp8_dtype, amax, with_transpose: bool):
    """The prevalidated entries' one check (state on the input's device) and their outputs:
    ``(contiguous input, QuantizeResult of empty buffers)``."""
    device = input.device
    if scale.device != device or (amax is not None and amax.device != device):
        check_tensors_on("quantize", "input", input, scale=scale, amax=amax)  # raises
    return _empty_outputs(input, fp8_dtype, with_transpose)


def _empty_outputs(input, fp8_dtype, with_transpose: bool):
    """``(contiguous input, QuantizeResult of new empty buffers on its device)``."""
    device = input.device
    input = input.contiguous()
    out = torch.empty(input.shape, dtype=fp8_dtype, device=device)
    out_t = None
    if with_transpose:
        out_t = torch.empty(transposed_shape(input.shape), dtype=fp8_dtype, device=device)
    scale_inv = torch.empty(1, dtype=torch.float32, device=device)
    return input, QuantizeResult(out, out_t, scale_inv)


# Rows per tile of the native dbias kernel: its workspace holds one float32 column sum per tile
# (nvte_quantize_dbias_workspace_elements; tests/pytorch/test_native_binding.py checks the two
# agree).
DBIAS_TILE_ROWS = 64


def dbias_workspace_elements(input: torch.Tensor) -> int:
    """Float32 elements of the native dbias workspace: one column sum per tile of rows."""
    cols = input.shape[-1]
    tiles = (input.numel() // cols + DBIAS_TILE_ROWS - 1) // DBIAS_TILE_ROWS
    return tiles * cols


def quantize_dbias_prevalidated(
    input: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax: torch.Tensor | None,
) -> tuple[QuantizeResult, torch.Tensor]:
    """:func:`quantize_prevalidated` with the transposed copy, plus ``input``'s sum over every
    dimension but the last (:func:`column_sum`: a linear layer's bias gradient from its
    output gradient), computed natively in the same pass over ``input``.

    Same caller contract as :func:`quantize_prevalidated`; ``input`` must have at least one
    element.
    """
    input, result = _prevalidated_outputs(input, scale, fp8_dtype, amax, with_transpose=True)
    device = input.device
    dbias = torch.empty(input.shape[-1], dtype=input.dtype, device=device)
    native = native_for("quantize", device)
    if native is not None:
        workspace = torch.empty(dbias_workspace_elements(input), dtype=torch.float32, device=device)
        native.quantize_dbias(
            tensor_arg(input), tensor_arg(scale), tensor_arg(result.data),
            tensor_arg(result.transpose), tensor_arg(amax), tensor_arg(result.scale_inv),
            tensor_arg(dbias), tensor_arg(workspace), *launch_args(device),
        )  # fmt: skip
    else:
        _run_quantize(input, scale, fp8_dtype, amax, result.scale_inv, result.data,
                      result.transpose, None)  # fmt: skip
        dbias.copy_(reference.column_sum(input))
    return result, dbias


def quantize_current_scaling_prevalidated(
    input: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    epsilon: float,
    force_pow_2_scales: bool,
    with_transpose: bool,
    with_dbias: bool,
) -> tuple[QuantizeResult, torch.Tensor | None]:
    """Current scaling's whole cast: ``amax(input)`` -> scale -> cast (+ transposed copy,
    + :func:`column_sum` when ``with_dbias``), as ``(QuantizeResult, dbias or None)``.

    On CUDA one native call (``nvte_quantize_current_scaling``) does what
    ``scaling.current_scale_prevalidated`` followed by :func:`quantize_prevalidated` (or
    :func:`quantize_dbias_prevalidated`) does, bit for bit, with one crossing into native code
    and one argument check instead of three; elsewhere it runs exactly those. The amax and scale live in a scratch buffer of this call
    (current scaling keeps neither). Same caller contract as :func:`quantize_prevalidated`;
    ``with_dbias`` needs ``with_transpose`` and a non-empty ``input``; there is no amax
    reduction here (the quantizer takes the composed path for that).
    """
    device = input.device
    native = native_for("quantize", device)
    if native is None:
        scale = current_scale_prevalidated(
            input, fp8_dtype, epsilon=epsilon, force_pow_2_scales=force_pow_2_scales
        )
        if with_dbias:
            return quantize_dbias_prevalidated(input, scale, fp8_dtype, amax=None)
        return quantize_prevalidated(
            input, scale, fp8_dtype, amax=None, with_transpose=with_transpose
        ), None
    input, result = _empty_outputs(input, fp8_dtype, with_transpose)
    dbias = dbias_arg = None
    workspace_elements = 0
    if with_dbias:
        workspace_elements = dbias_workspace_elements(input)
        dbias = torch.empty(input.shape[-1], dtype=input.dtype, device=device)
        dbias_arg = tensor_arg(dbias)
    # The dbias workspace (first, so it keeps the allocator's alignment), the amax pass's
    # per-block maxima, then the amax and the scale, in one allocation. Freeing it while the
    # kernels run is safe: the allocator hands the block only to later work on this stream.
    _scratch, (workspace_arg, maxima_arg, amax_arg, scale_arg) = float32_scratch(
        device, workspace_elements, AMAX_WORKSPACE_ELEMENTS, 1, 1
    )
    if not with_dbias:
        workspace_arg = None
    native.quantize_current_scaling(
        tensor_arg(input), tensor_arg(result.data), tensor_arg(result.transpose), amax_arg,
        scale_arg, tensor_arg(result.scale_inv), float(epsilon), bool(force_pow_2_scales),
        dbias_arg, workspace_arg, *launch_args(device), maxima_arg,
    )  # fmt: skip
    return result, dbias


def column_sum(input: torch.Tensor) -> torch.Tensor:
    """The bias gradient of a linear layer from its output gradient ``input``: the sum over
    every dimension but the last, accumulated in float32 and rounded once to ``input``'s dtype.

    There is no standalone native kernel (the native sum runs fused into
    :func:`quantize_dbias_prevalidated`), so every device runs the reference math with torch
    operations on ``input``'s device. A 0-d ``input`` raises ``ValueError``.
    """
    return reference.column_sum(input)


def _run_quantize(
    input, scale, dtype, amax, scale_inv, out_fp8, out_t_fp8, noop_flag, *, consume_input=False
) -> None:
    """The cast itself: native on CUDA, the reference elsewhere (arguments already checked;
    ``consume_input`` as in :func:`reference.cast_to_fp8_with_amax`)."""
    native = native_for("quantize", input.device)
    if native is not None:
        native.quantize(
            tensor_arg(input), tensor_arg(scale), tensor_arg(out_fp8), tensor_arg(out_t_fp8),
            tensor_arg(amax), tensor_arg(scale_inv), tensor_arg(noop_flag),
            *launch_args(input.device),
        )  # fmt: skip
    elif noop_flag is None or float(noop_flag.reshape(())) != 1.0:
        # Written straight into the outputs (no intermediate FP8 tensor or transposed copy).
        _, input_amax = reference.cast_to_fp8_with_amax(
            input, scale, dtype, out=out_fp8, consume_input=consume_input
        )
        if out_t_fp8 is not None:
            reference.transpose_last_dim_first(out_fp8, out=out_t_fp8)
        if amax is not None:
            torch.maximum(amax.view(1), input_amax, out=amax.view(1))
        scale_inv.view(1).copy_(reference.reciprocal(scale))


def dequantize(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``data * scale_inv`` in float32, rounded once to ``out_dtype`` (float32, float16, bfloat16)."""
    op = "dequantize"
    check_tensor(op, "data", data)
    check_dtype(op, "data", data, (torch.float8_e4m3fn, torch.float8_e5m2))
    check_fp32_scalar(op, "scale_inv", scale_inv)
    if out_dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{op}: out_dtype={out_dtype} is not supported; use torch.float32, torch.float16 "
            "or torch.bfloat16"
        )
    check_output(op, "out", out, data.shape, (out_dtype,))
    check_tensors_on(op, "data", data, scale_inv=scale_inv, out=out)

    data = data.contiguous()
    device = data.device
    if out is None:
        out = torch.empty(data.shape, dtype=out_dtype, device=device)
    native = native_for(op, device)
    if native is not None:
        native.dequantize(
            tensor_arg(data), tensor_arg(scale_inv), tensor_arg(out), *launch_args(device)
        )
    else:
        out.copy_(reference.dequantize(data, scale_inv, out_dtype))
    return out


def compute_amax(input: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``max |input|`` in float32 (NaN ignored), written over ``out`` (a one-element buffer)."""
    op = "compute_amax"
    check_tensor(op, "input", input)
    check_dtype(op, "input", input, HIGH_PRECISION_DTYPES)
    check_fp32_scalar(op, "out", out)
    check_tensors_on(op, "input", input, out=out)

    input = input.contiguous()
    device = input.device
    if out is None:
        out = torch.empty(1, dtype=torch.float32, device=device)
    native = native_for(op, device)
    if native is not None:
        native.compute_amax(tensor_arg(input), tensor_arg(out), *launch_args(device))
    else:
        out.view(1).copy_(reference.amax(input))
    return out
