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

import torch

from transformer_engine.pytorch.constants import FP8_DTYPES
from transformer_engine.pytorch.cpp_extensions import general_gemm
from transformer_engine.pytorch.cpp_extensions.gemm_epilogues import (
    gemm_with_epilogues,
    refuse_unbuilt_epilogues,
)
from transformer_engine.pytorch.quantized_tensor import Quantizer

from ._dtype_args import high_precision_dtype, torch_dtype

__all__ = ["generic_gemm", "get_num_cublas_streams"]

_OP = "generic_gemm"


def _layout(transA, transB) -> str:
    layout = ("T" if transA else "N") + ("T" if transB else "N")
    if layout == "TT":
        raise ValueError(
            f"{_OP}: transA={transA!r} and transB={transB!r} ask for layout 'TT', which has no "
            "GEMM here; use TN (fprop), NN (dgrad) or NT (wgrad)"
        )
    return layout


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
    overlap = {"comm_overlap": comm_overlap, "comm_type": comm_type, "extra_output": extra_output}
    refuse_unbuilt_epilogues(_OP, gelu=gelu, overlap=overlap, bulk_overlap=bulk_overlap)
    if quantizer is not None and not isinstance(quantizer, Quantizer):
        raise TypeError(
            f"{_OP}: quantizer must be None or a transformer_engine.pytorch Quantizer, got "
            f"{type(quantizer).__name__}"
        )
    out_dtype = _output_dtype(output_dtype, quantizer)
    bias_grad_dtype = None
    if grad and bias is not None and bias_type is not None:
        bias_grad_dtype = high_precision_dtype(_OP, "bias_type", bias_type)
    out, bias_grad = gemm_with_epilogues(
        _OP, general_gemm, A, B, out_dtype, quantizer=quantizer, alpha=alpha, beta=beta,
        accumulate=accumulate, layout=layout, out=D, bias=bias, bias_grad_dtype=bias_grad_dtype,
        use_split_accumulator=use_split_accumulator, grad=grad, out_name="D",
    )  # fmt: skip
    return [out, bias_grad, None, None]


def get_num_cublas_streams() -> int:
    """How many streams the grouped GEMM spreads its groups over: 1 here. Upstream's kernels
    round-robin groups over several cuBLAS streams (and callers size per-stream workspaces by
    this number); here every group runs in turn on the caller's current stream."""
    return 1
