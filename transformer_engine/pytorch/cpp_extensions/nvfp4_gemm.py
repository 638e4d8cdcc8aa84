"""The NVFP4 GEMM (``NVFP4BlockScaling``) by exact emulation, on every device.

Native NVFP4 GEMMs need Blackwell (compute capability 10.0 or newer) and are not built here.
Each NVFP4 operand is read through ``nvfp4_gemm_input(columnwise)``: the copy the layout needs
(as for MXFP8: TN reads both row-wise copies, NN A's column-wise and B's row-wise, NT both
column-wise copies), dequantized to float32 (E2M1 times E4M3 is exact; the division by the
global scale rounds once). The product is a float32 ``torch.mm`` with ``alpha``, bias and
accumulation applied in float32 and the result rounded once
(:func:`.mxfp8_gemm.emulated_product`).

The random Hadamard transform is orthogonal, so when both operands carry it along the reduced
dim with the same sign vector (the wgrad GEMM of two RHT copies, as upstream pairs them) the
transformed values are multiplied as they are, which is what a native NVFP4 GEMM computes;
an RHT copy met by an operand without one (or with another sign vector) is transformed back
first, so the product is never of mismatched bases.
"""

from __future__ import annotations

import torch

from .. import reference_fp4 as fp4
from .mxfp8_gemm import emulated_product

__all__ = ["is_nvfp4_operand", "nvfp4_general_gemm"]

_OP = "general_gemm"


def is_nvfp4_operand(operand) -> bool:
    """Whether ``operand`` is an NVFP4 tensor or storage (has ``nvfp4_gemm_input``)."""
    return hasattr(operand, "nvfp4_gemm_input")


def _values(name: str, operand, columnwise: bool, layout: str):
    """``(float32 values of the logical shape, RHT sign-mask flag or None)``."""
    if is_nvfp4_operand(operand):
        values, rht = operand.nvfp4_gemm_input(columnwise)
        if values is None:
            which = "columnwise" if columnwise else "rowwise"
            raise ValueError(
                f"{_OP}: layout {layout!r} reads {name} {which}, but {name} holds no {which} "
                f"NVFP4 data (usages {operand.get_usages()}); quantize it with {which} usage"
            )
        return values, rht
    if hasattr(operand, "_dequantize_plain"):
        return operand._dequantize_plain(torch.float32), None
    if hasattr(operand, "dequantize") and not isinstance(operand, torch.Tensor):
        return operand.dequantize(dtype=torch.float32), None
    return operand.float(), None


def _undo_rht(values: torch.Tensor, rht: bool) -> torch.Tensor:
    """Inverse RHT along ``M`` (the rows) of an ``[M, K]`` matrix."""
    return fp4.apply_rht(values.t(), inverse=True, with_random_sign_mask=rht).t()


def nvfp4_general_gemm(A, B, out_dtype, *, layout, out, bias, accumulate, alpha):
    """:func:`.gemm.general_gemm` when at least one operand is NVFP4 (see the module
    docstring). Returns ``(out, None, None, None)`` like ``general_gemm``."""
    if accumulate and out is None:
        raise ValueError(f"{_OP}: accumulate=True adds into out, so out must be given")
    a, a_rht = _values("A", A, layout != "TN", layout)
    b, b_rht = _values("B", B, layout == "NT", layout)
    if not (layout == "NT" and a_rht is not None and a_rht == b_rht):
        if a_rht is not None:
            a = _undo_rht(a, a_rht)
        if b_rht is not None:
            b = _undo_rht(b, b_rht)
    a = a.reshape(A.size()) if is_nvfp4_operand(A) else a
    b = b.reshape(B.size()) if is_nvfp4_operand(B) else b
    return emulated_product(a, b, A, B, out_dtype, layout, out, bias, accumulate, alpha)
