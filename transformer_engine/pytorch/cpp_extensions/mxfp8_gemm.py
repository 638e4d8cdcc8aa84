"""The MXFP8 GEMM (``MXFP8BlockScaling``) by exact emulation, on every device.

Native MXFP8 GEMMs exist only on Blackwell (compute capability 10.x/11.x) and are not built
here. Each MXFP8 operand is read through ``mxfp8_gemm_input(columnwise)``: the copy the layout
needs, dequantized to a float32 ``[M, K]`` matrix of its logical shape (FP8 values times
power-of-2 scales are exact in float32). Which copy (upstream's rule, as in
:mod:`.block_gemm`): TN (fprop) reads both row-wise copies; NN (dgrad) A's (the weight's)
column-wise copy, whose blocks run along the reduced dim, and B's row-wise; NT (wgrad) both
column-wise copies. The product is a float32 ``torch.mm``; bias and ``alpha`` are applied in
float32 and the result rounded once. A non-MXFP8 operand enters as its float32 values. On the
CPU, two MXFP8 operands multiply in oneDNN's BF16 math mode when that is exact (E8M0 scales are
powers of two, so every value is a BF16 number; the scales' exponents must rule out subnormals
and overflow: :func:`.fp8_gemm_cpu.bf16_math_is_exact`), as the other emulated FP8 GEMMs do.
"""

from __future__ import annotations

import torch

from ..constants import to_torch_fp8_dtype
from .fp8_gemm_cpu import bf16_math_is_exact, float32_product_of_fp8_values

__all__ = ["is_mxfp8_operand", "mxfp8_general_gemm", "emulated_product"]

_OP = "general_gemm"


def is_mxfp8_operand(operand) -> bool:
    """Whether ``operand`` is an MXFP8 tensor or storage (has ``mxfp8_gemm_input``)."""
    return hasattr(operand, "mxfp8_gemm_input")


def _values(name: str, operand, columnwise: bool, layout: str) -> torch.Tensor:
    """``operand`` as float32 of its logical shape, from the copy ``layout`` reads."""
    if is_mxfp8_operand(operand):
        values = operand.mxfp8_gemm_input(columnwise)
        if values is None:
            which = "columnwise" if columnwise else "rowwise"
            raise ValueError(
                f"{_OP}: layout {layout!r} reads {name} {which}, but {name} holds no {which} "
                f"MXFP8 data (usages {operand.get_usages()}); quantize it with {which} usage"
            )
        return values.reshape(operand.size())
    if hasattr(operand, "_dequantize_plain"):
        return operand._dequantize_plain(torch.float32)
    if hasattr(operand, "dequantize") and not isinstance(operand, torch.Tensor):
        return operand.dequantize(dtype=torch.float32)
    return operand.float()


def mxfp8_general_gemm(A, B, out_dtype, *, layout, out, bias, accumulate, alpha):
    """:func:`.gemm.general_gemm` when at least one operand is MXFP8 (see the module
    docstring). Returns ``(out, None, None, None)`` like ``general_gemm``."""
    if accumulate and out is None:
        raise ValueError(f"{_OP}: accumulate=True adds into out, so out must be given")
    a = _values("A", A, layout != "TN", layout)
    b = _values("B", B, layout == "NT", layout)
    bf16_exact = a.device.type == "cpu" and _bf16_exact(A, B, layout, a, b)
    return emulated_product(
        a, b, A, B, out_dtype, layout, out, bias, accumulate, alpha, bf16_exact=bf16_exact
    )


def _bf16_exact(A, B, layout: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two MXFP8 operands' product is exact in BF16 math (module docstring); ``a``,
    ``b`` their values in logical shapes."""
    if not (is_mxfp8_operand(A) and is_mxfp8_operand(B)) or b.dim() == 0 or a.dim() == 0:
        return False
    a_exp = A.mxfp8_gemm_scale_exponents(layout != "TN")
    b_exp = B.mxfp8_gemm_scale_exponents(layout == "NT")
    if a_exp is None or b_exp is None:
        return False
    k = {"TN": a.shape[-1], "NN": a.shape[0]}.get(layout, b.numel() // max(b.shape[-1], 1))
    a_fp8, b_fp8 = to_torch_fp8_dtype(A._fp8_dtype), to_torch_fp8_dtype(B._fp8_dtype)
    return bf16_math_is_exact(a_fp8, a_exp, b_fp8, b_exp, k)


def emulated_product(
    a, b, A, B, out_dtype, layout, out, bias, accumulate, alpha, *, bf16_exact=False
):
    """The float32 product of the operands' values ``a`` and ``b`` (logical shapes) for
    ``layout``, with ``alpha``, bias and accumulation, rounded once; shared by the emulated
    block-scaled GEMMs. ``A`` and ``B`` are the operands as given (for messages).
    ``bf16_exact``: the caller has checked that BF16 math is exact for these values."""
    if layout in ("TN", "NN") and a.dim() != 2:
        raise ValueError(f"{_OP}: layout {layout!r} needs a 2-D A (the weight), got {a.shape}")
    if a.device != b.device:
        raise ValueError(f"{_OP}: A is on {a.device} but B on {b.device}; move them to one device")
    if layout == "TN":
        x, y, out_shape = b.reshape(-1, a.shape[1]), a, (*b.shape[:-1], a.shape[0])
    elif layout == "NN":
        x, y, out_shape = b.reshape(-1, a.shape[0]), a.t(), (*b.shape[:-1], a.shape[1])
    else:
        x = b.reshape(-1, b.shape[-1]).t()
        y = a.reshape(-1, a.shape[-1]).t()
        out_shape = (b.shape[-1], a.shape[-1])
    if x.shape[1] != y.shape[1]:
        raise ValueError(
            f"{_OP}: K mismatch for layout {layout!r}: A shape {tuple(A.shape)}, B shape "
            f"{tuple(B.shape)}"
        )
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else torch.bfloat16
    result = float32_product_of_fp8_values(x, y) if bf16_exact else x @ y.t()
    if alpha != 1.0:
        result = result * alpha
    if bias is not None:
        result = result + bias.float()
    result = result.reshape(out_shape)
    if accumulate:
        if out.dtype == torch.float32:
            out.add_(result)
        else:
            out.copy_(out.float() + result)
        return out, None, None, None
    result = result.to(out_dtype)
    if out is not None:
        out.copy_(result)
        return out, None, None, None
    return result, None, None, None
