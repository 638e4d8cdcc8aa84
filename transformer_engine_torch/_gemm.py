"""Upstream's ``generic_gemm``, with its positional argument order, over
:func:`transformer_engine.pytorch.cpp_extensions.general_gemm`.

Upstream names the layout by two flags, cuBLAS style: ``transA`` / ``transB`` give the layout
``"TN"`` (fprop, ``B @ A^T``), ``"NN"`` (dgrad, ``B @ A``) or ``"NT"`` (wgrad, ``B^T @ A``),
in row-major terms ``D = op(B) @ op(A)``. Operands are plain float32/float16/bfloat16 tensors
or per-tensor FP8 tensors (``Float8Tensor``, ``Float8TensorStorage``).

Built here: the three layouts, bias add, the bias gradient of a wgrad GEMM, ``alpha``,
``beta`` with ``accumulate``, split accumulation, and an FP8 (or other quantized) output
through ``quantizer``. Not built, and refused with an error naming the argument: the GELU
epilogues (``gelu``) and communication overlap (``comm_overlap``, ``comm_type``,
``extra_output``, ``bulk_overlap``: userbuffers are not part of this package).
"""

from __future__ import annotations

import numbers

import torch

from transformer_engine.pytorch.constants import FP8_DTYPES
from transformer_engine.pytorch.cpp_extensions import general_gemm
from transformer_engine.pytorch.cpp_extensions.cast import column_sum
from transformer_engine.pytorch.quantized_tensor import (
    QuantizedTensor,
    QuantizedTensorStorage,
    Quantizer,
)

from ._dtype_args import high_precision_dtype, torch_dtype

__all__ = ["generic_gemm"]

_OP = "generic_gemm"


def _layout(transA, transB) -> str:
    layout = ("T" if transA else "N") + ("T" if transB else "N")
    if layout == "TT":
        raise ValueError(
            f"{_OP}: transA={transA!r} and transB={transB!r} ask for layout 'TT', which has no "
            "GEMM here; use TN (fprop), NN (dgrad) or NT (wgrad)"
        )
    return layout


def _refuse_unbuilt(gelu, comm_overlap, comm_type, extra_output, bulk_overlap) -> None:
    if gelu:
        raise NotImplementedError(
            f"{_OP}: gelu=True asks for the GELU (forward) or GELU-gradient (grad=True) "
            "epilogue, which is not built here; call with gelu=False and apply the activation "
            "separately"
        )
    for name, value in (
        ("comm_overlap", comm_overlap),
        ("comm_type", comm_type),
        ("extra_output", extra_output),
    ):
        if value is not None:
            raise NotImplementedError(
                f"{_OP}: {name}={value!r} asks for userbuffers communication overlap, which is "
                f"not built here; pass {name}=None"
            )
    if bulk_overlap:
        raise NotImplementedError(
            f"{_OP}: bulk_overlap=True asks for userbuffers communication overlap, which is "
            "not built here; pass bulk_overlap=False"
        )


def _output_dtype(output_dtype, quantizer) -> torch.dtype | None:
    """The torch dtype of the high-precision result (for a quantized output: its nominal type)."""
    if output_dtype is None:
        return None
    dtype = torch_dtype(_OP, "output_dtype", output_dtype)
    if dtype in FP8_DTYPES:
        if quantizer is None:
            raise TypeError(
                f"{_OP}: output_dtype={output_dtype!r} is an FP8 type but quantizer is None; "
                "pass the output quantizer that decides the FP8 scale"
            )
        return None  # the quantizer decides the format; the nominal type is the default one
    return high_precision_dtype(_OP, "output_dtype", output_dtype)


def _is_fp8(operand) -> bool:
    return hasattr(operand, "float8_gemm_input")


def _bias_grad(B, bias, bias_type, layout: str) -> torch.Tensor:
    """The wgrad bias gradient: ``B`` (the output gradient) summed over the reduction dims."""
    if layout != "NT":
        raise NotImplementedError(
            f"{_OP}: grad=True with a bias asks for the bias gradient of B, which is built for "
            f"the wgrad layout NT (transA=False, transB=True) only, not {layout}; compute it "
            "with bgrad_quantize or a sum over the output gradient's rows"
        )
    dtype = bias.dtype if bias_type is None else high_precision_dtype(_OP, "bias_type", bias_type)
    if isinstance(B, torch.Tensor) and not isinstance(B, QuantizedTensor):
        values = B.float()
    elif isinstance(B, QuantizedTensorStorage):
        with torch.no_grad():
            values = B.dequantize(dtype=torch.float32)
    else:
        raise TypeError(
            f"{_OP}: grad=True with a bias needs B as a tensor or a quantized tensor to sum, "
            f"got {type(B).__name__}"
        )
    return column_sum(values).to(dtype)


def generic_gemm(
    A,
    transA,
    B,
    transB,
    D,
    quantizer,
    output_dtype,
    bias,
    bias_type,
    gelu,
    gelu_in,
    grad,
    workspace,
    workspace_size,
    accumulate,
    use_split_accumulator,
    comm_overlap=None,
    comm_type=None,
    extra_output=None,
    bulk_overlap=False,
    alpha=1.0,
    beta=None,
):
    """``D = alpha * op(B) @ op(A) (+ bias) (+ beta * D)``; returns
    ``[out, bias_grad, pre_gelu_out, extra_output]`` (see the module docstring).

    Args:
        A, B: the operands (plain high-precision or per-tensor FP8 tensors).
        transA, transB: the layout flags.
        D: output buffer, or ``None`` to allocate. With ``quantizer`` it must be a quantized
            tensor of that quantizer's kind, overwritten in place.
        quantizer: ``None`` for a high-precision output; otherwise the output quantizer. The
            product is formed in float32 and quantized once (as a fused FP8 epilogue rounds).
        output_dtype: ``DType`` of a high-precision output (its nominal type with a quantizer);
            ``None``: ``D``'s, else bfloat16 for FP8 x FP8, else the operands'.
        bias, bias_type: with ``grad=False`` the bias added to every output row; with
            ``grad=True`` a flag: the bias gradient of the wgrad layout comes back in slot 1, of
            type ``bias_type`` (``None``: the bias's dtype).
        gelu, gelu_in: must be ``False`` / unused (the GELU epilogues are not built).
        grad: backward GEMM (see ``bias``).
        workspace, workspace_size: unused; the GEMMs run on PyTorch's cuBLAS(Lt) handles and
            workspaces.
        accumulate: add into ``D`` (``D`` required); ``beta`` (default 1 when accumulating,
            else 0) scales the old ``D``. A non-zero ``beta`` without ``accumulate`` is refused.
        use_split_accumulator: FP8: full float32 accumulation instead of the fast mode.
        comm_overlap, comm_type, extra_output, bulk_overlap: must be left at their defaults.
        alpha: scale of the product.
    """
    layout = _layout(transA, transB)
    _refuse_unbuilt(gelu, comm_overlap, comm_type, extra_output, bulk_overlap)
    if quantizer is not None and not isinstance(quantizer, Quantizer):
        raise TypeError(
            f"{_OP}: quantizer must be None or a transformer_engine.pytorch Quantizer, got "
            f"{type(quantizer).__name__}"
        )
    out_dtype = _output_dtype(output_dtype, quantizer)
    if isinstance(beta, bool) or (beta is not None and not isinstance(beta, numbers.Real)):
        raise TypeError(f"{_OP}: beta must be None or a real number, got {beta!r}")
    beta = (1.0 if accumulate else 0.0) if beta is None else float(beta)
    if beta != 0.0 and not accumulate:
        raise ValueError(
            f"{_OP}: beta={beta} scales the old D, but accumulate=False; pass accumulate=True "
            "(with D) or beta=None"
        )
    if accumulate and D is None:
        raise ValueError(f"{_OP}: accumulate=True adds into D, so D must be given")
    if quantizer is not None and accumulate and beta != 0.0:
        raise ValueError(
            f"{_OP}: accumulate=True with an output quantizer would add into quantized "
            "values; accumulate into a high-precision D (quantizer=None) instead"
        )
    if quantizer is None and isinstance(D, QuantizedTensorStorage):
        raise TypeError(
            f"{_OP}: D is a quantized tensor ({type(D).__name__}) but quantizer is None; pass "
            "the quantizer that writes it, or a high-precision D"
        )
    if quantizer is not None and D is not None and not isinstance(D, QuantizedTensorStorage):
        raise TypeError(
            f"{_OP}: quantizer is given, so D must be a quantized tensor to overwrite (or "
            f"None), got {type(D).__name__}"
        )

    bias_grad = None
    if grad and bias is not None:
        bias_grad = _bias_grad(B, bias, bias_type, layout)
        bias = None  # a flag only: the backward GEMM adds no bias
    kw = dict(layout=layout, bias=bias, use_split_accumulator=use_split_accumulator, alpha=alpha)

    if quantizer is not None:
        product = general_gemm(A, B, torch.float32, **kw)[0]
        if out_dtype is None:
            fp8_operands = _is_fp8(A) and _is_fp8(B)
            plain = B if not _is_fp8(B) else A
            out_dtype = torch.bfloat16 if fp8_operands else plain.dtype
        with torch.no_grad():
            if D is None:
                out = quantizer.quantize_impl(product, dtype=out_dtype)
            else:
                out = quantizer.update_quantized(product, D)
    elif accumulate and beta == 0.0:
        out = general_gemm(A, B, out_dtype, out=D, **kw)[0]  # beta = 0: the old D is not read
    elif accumulate and beta != 1.0:
        product = general_gemm(A, B, torch.float32, **kw)[0]
        if out_dtype is not None and out_dtype != D.dtype:
            raise TypeError(
                f"{_OP}: output_dtype is {out_dtype} but D is {D.dtype}; they must agree"
            )
        if tuple(D.shape) != tuple(product.shape):
            raise ValueError(
                f"{_OP}: D has shape {tuple(D.shape)} but the product has "
                f"{tuple(product.shape)}; pass a D of the output's shape"
            )
        out = D.copy_(D.float() * beta + product)  # one rounding to D's type
    else:
        out = general_gemm(A, B, out_dtype, out=D, accumulate=accumulate, **kw)[0]
    return [out, bias_grad, None, None]
