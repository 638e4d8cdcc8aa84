"""Upstream's GEMM epilogues over the plain GEMM: an FP8 (or other quantized) output, ``beta``
with ``accumulate``, and the bias gradient of the wgrad layout.

``general_gemm`` (and ``transformer_engine_torch.generic_gemm`` above it) take these arguments
as upstream's do. cuBLASLt would fuse them into the GEMM; here each is formed from the GEMM's
float32 product, which gives the values a fused epilogue gives (one rounding to the output
type). The GELU and userbuffers epilogues are not built: :func:`refuse_unbuilt_epilogues`
names the argument.

The plain GEMM comes in as an argument (``gemm(A, B, out_dtype, *, layout, out, bias,
accumulate, use_split_accumulator, alpha)`` returning ``(out, ...)``), so this module does not
import the GEMM module that calls it.
"""

from __future__ import annotations

import numbers

import torch

from .cast import column_sum

__all__ = ["refuse_unbuilt_epilogues", "gemm_with_epilogues"]


def refuse_unbuilt_epilogues(op: str, *, gelu, overlap: dict, bulk_overlap) -> None:
    """``NotImplementedError`` naming the first epilogue asked for that is not built: ``gelu``,
    or one of the userbuffers arguments in ``overlap`` (name -> value, ``None`` when unused)."""
    if gelu:
        raise NotImplementedError(
            f"{op}: gelu=True asks for the GELU (forward) or GELU-gradient (grad=True) "
            "epilogue, which is not built here; call with gelu=False and apply the activation "
            "separately"
        )
    for name, value in overlap.items():
        if value is not None:
            raise NotImplementedError(
                f"{op}: {name}={value!r} asks for userbuffers communication overlap, which is "
                f"not built here; pass {name}=None"
            )
    if bulk_overlap:
        raise NotImplementedError(
            f"{op}: bulk_overlap=True asks for userbuffers communication overlap, which is "
            "not built here; pass bulk_overlap=False"
        )


def _is_quantized(tensor) -> bool:
    """A quantized tensor or storage of this package (every one has ``update_usage``; a plain
    tensor, a ``Parameter`` included, has not; this layer cannot import their classes)."""
    return hasattr(tensor, "update_usage")


def _bias_gradient(op: str, B, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """The wgrad bias gradient: ``B`` (the output gradient) summed over its rows, in float32,
    rounded once to ``dtype``."""
    if layout != "NT":
        raise NotImplementedError(
            f"{op}: grad=True with a bias asks for the bias gradient of B, which is built for "
            f"the wgrad layout NT only, not {layout}; compute it as a sum over the output "
            "gradient's rows"
        )
    if _is_quantized(B):
        with torch.no_grad():
            values = B.dequantize(dtype=torch.float32)
    elif isinstance(B, torch.Tensor):
        values = B.float()
    else:
        raise TypeError(
            f"{op}: grad=True with a bias needs B as a tensor or a quantized tensor to sum, "
            f"got {type(B).__name__}"
        )
    return column_sum(values).to(dtype)


def _check_epilogue_arguments(op, quantizer, beta, accumulate, out, name) -> float:
    """Validate the combination before any work; returns ``beta`` as a float."""
    if quantizer is not None and not hasattr(quantizer, "quantize_impl"):
        raise TypeError(
            f"{op}: the output quantizer must be None or a transformer_engine.pytorch "
            f"Quantizer, got {type(quantizer).__name__}"
        )
    if isinstance(beta, bool) or (beta is not None and not isinstance(beta, numbers.Real)):
        raise TypeError(f"{op}: beta must be None or a real number, got {beta!r}")
    beta = (1.0 if accumulate else 0.0) if beta is None else float(beta)
    if beta != 0.0 and not accumulate:
        raise ValueError(
            f"{op}: beta={beta} scales the old {name}, but accumulate=False; pass "
            f"accumulate=True (with {name}) or beta=None"
        )
    if accumulate and out is None:
        raise ValueError(f"{op}: accumulate=True adds into {name}, so {name} must be given")
    if quantizer is not None and accumulate and beta != 0.0:
        raise ValueError(
            f"{op}: accumulate=True with an output quantizer would add into quantized values; "
            f"accumulate into a high-precision {name} (no quantizer) instead"
        )
    if quantizer is None and out is not None and _is_quantized(out):
        raise TypeError(
            f"{op}: {name} is a quantized tensor ({type(out).__name__}) but no output "
            f"quantizer is given; pass the quantizer that writes it, or a high-precision {name}"
        )
    if quantizer is not None and out is not None and not _is_quantized(out):
        raise TypeError(
            f"{op}: an output quantizer is given, so {name} must be a quantized tensor to "
            f"overwrite (or None), got {type(out).__name__}"
        )
    return beta


def gemm_with_epilogues(
    op: str,
    gemm,
    A,
    B,
    out_dtype: torch.dtype | None,
    *,
    quantizer,
    alpha: float,
    beta,
    accumulate: bool,
    layout: str,
    out,
    bias: torch.Tensor | None,
    bias_grad_dtype: torch.dtype | None,
    use_split_accumulator: bool,
    grad: bool,
    out_name: str = "out",
):
    """``alpha * op(B) @ op(A) (+ bias) (+ beta * out)`` through ``gemm``; returns
    ``(out, bias_grad)``.

    ``quantizer``: the product is formed in float32 and quantized once, into ``out`` (a
    quantized tensor) when given, of nominal type ``out_dtype`` (default: bfloat16 for two FP8
    operands, else the plain operand's type). ``beta`` (default 1 with ``accumulate``, else 0)
    scales the old ``out``; the sum is rounded once to ``out``'s type. With ``grad=True`` a
    ``bias`` is a flag: no bias is added, and the bias gradient of the wgrad layout (``B``
    summed over its rows) comes back, of type ``bias_grad_dtype`` (default the bias's).
    ``out_name``: what the caller calls ``out``, for the error messages.
    """
    beta = _check_epilogue_arguments(op, quantizer, beta, accumulate, out, out_name)
    bias_grad = None
    if grad and bias is not None:
        dtype = bias.dtype if bias_grad_dtype is None else bias_grad_dtype
        bias_grad = _bias_gradient(op, B, dtype, layout)
        bias = None  # a flag only: the backward GEMM adds no bias
    kw = dict(layout=layout, bias=bias, use_split_accumulator=use_split_accumulator, alpha=alpha)

    if quantizer is not None:
        product = gemm(A, B, torch.float32, **kw)[0]
        if out_dtype is None:
            fp8_operands = hasattr(A, "float8_gemm_input") and hasattr(B, "float8_gemm_input")
            plain = A if hasattr(B, "float8_gemm_input") else B
            out_dtype = torch.bfloat16 if fp8_operands else plain.dtype
        with torch.no_grad():
            if out is None:
                return quantizer.quantize_impl(product, dtype=out_dtype), bias_grad
            return quantizer.update_quantized(product, out), bias_grad
    if accumulate and beta == 0.0:  # the old output is not read
        return gemm(A, B, out_dtype, out=out, **kw)[0], bias_grad
    if accumulate and beta != 1.0:
        product = gemm(A, B, torch.float32, **kw)[0]
        if out_dtype is not None and out_dtype != out.dtype:
            raise TypeError(
                f"{op}: out_dtype is {out_dtype} but out is {out.dtype}; they must agree"
            )
        if tuple(out.shape) != tuple(product.shape):
            raise ValueError(
                f"{op}: {out_name} has shape {tuple(out.shape)} but the product has "
                f"{tuple(product.shape)}; pass a {out_name} of the product's shape"
            )
        return out.copy_(out.float() * beta + product), bias_grad  # one rounding
    return gemm(A, B, out_dtype, out=out, accumulate=accumulate, **kw)[0], bias_grad
