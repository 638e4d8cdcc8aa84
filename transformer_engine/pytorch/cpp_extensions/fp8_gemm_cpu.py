"""The FP8 x FP8 GEMM on the CPU: an exact float32 emulation of ``torch._scaled_mm``, used
where ``torch._scaled_mm`` has no compiled CPU kernel.

``torch._scaled_mm`` on the CPU goes to oneDNN. oneDNN 3.12 (torch 2.13) compiles an FP8 matmul
only for CPUs with AMX-FP16 (e.g. Xeon 6 / Granite Rapids: ``brg_matmul:avx10_1_512_amx_fp16``);
on every other CPU, including Xeons with AMX-BF16 only, it picks its reference kernel
(``ref:any``): about 0.5-1.1 s for a 512x128x512 product, which made FP8 training on the CPU
unusable (issue 14). :data:`SCALED_MM_IS_NATIVE_ON_CPU` says which case this machine is; the GEMM
runs :func:`fp8_gemm_emulated` whenever it is ``False``.

The emulation needs no special instructions and is exact up to the float32 accumulation:

* every E4M3 and E5M2 value is exactly representable in float32, so the upcast is exact
  (nothing is dequantized: the scales stay out of the operands); it goes through float16 bit
  moves (:func:`reference.fp8_to_float32_unscaled`), since torch's own E4M3 upcast converts
  element by element and cost more than the GEMM. Those give an E4M3 operand times ``2**-8``;
  the factor ``2**8`` (``2**16`` for two E4M3 operands) is applied to the accumulator, folded
  into the scale product, which gives the same bits as upcasting each operand exactly: every
  product and every partial sum of the scaled GEMM is the unscaled one times ``2**-8`` or
  ``2**-16`` *exactly*, because a float32 rounding commutes with a power of two as long as
  nothing is subnormal or overflows, and nothing is: the scaled operands are multiples of
  ``2**-17`` (E4M3's smallest subnormal ``2**-9`` times ``2**-8``), so every product and
  every rounded sum is 0 or a multiple of ``2**-34`` (a float32 normal: at least ``2**-126``),
  and the unscaled sums stay below ``K * 448 * 57344``, far from overflow. Multiplying the
  float32 scale product by the factor is exact for a normal scale whose product stays finite;
  any other scale (0, subnormal, huge, Inf, NaN) takes the factor on the accumulator first,
  exact for the same reasons, then the scale;
* the product of two FP8 values has at most 8 significant bits, so every product is exact in
  float32 and the only rounding inside ``torch.mm`` is the float32 accumulation (always full
  float32: ``use_split_accumulator`` has nothing to select here);
* the per-tensor scales are multiplied in float32 and applied to the float32 accumulator, the
  bias is added in float32, and the result is rounded once to the output dtype, as cuBLASLt's
  epilogue does on a GPU.

The GEMM is a float32 ``torch.mm``, run in oneDNN's BF16 math mode where that is safe
(:func:`float32_product_of_fp8_values`): every upcast FP8 value (times its power-of-two factor)
is a BF16 number, so the mode's rounding of the operands to BF16 changes nothing, the products
are exact in float32 and the accumulation stays float32 (AMX-BF16 flushes subnormals, and none
occurs, as above); it is about 4x faster on a CPU with BF16 instructions (1024x256x1024 on this
project's 2-core VM: 0.4 ms against 1.6 ms). The mode is a process-wide setting, so flipping it
around the call would change the precision of another thread's float32 matmuls running at the
same moment: it is used only while this process runs one Python thread, and a process with more
keeps the plain float32 GEMM (same exactness, slower), unless ``NVTE_CPU_GEMM_BF16_MATH=1``
(the user vouches that no other thread runs float32 CPU matmuls meanwhile; ``0`` turns it off).

It differs from ``torch._scaled_mm`` only by the order of the float32 accumulation
(``tests/pytorch/kernels/test_fp8_gemm_cpu.py`` pins it against ``torch._scaled_mm`` and a
float64 oracle). BF16 would hold the operands exactly too, but PyTorch's CPU BF16 GEMM rounds
its output to BF16 before the scale could be applied, so it cannot give the single rounding.
On an AMX-FP16 CPU oneDNN's FP8 kernel is faster than the float32 GEMM (1024x256x1024 on one
core: 1.6 ms against 5.2 ms), so it is kept there.
"""

from __future__ import annotations

import os
import threading

import torch

from ..reference import fp8_to_float32_unscaled
from .hp_gemm_cpu import onednn_has_16bit_kernels

__all__ = [
    "fp8_gemm_emulated",
    "float32_product_of_fp8_values",
    "bf16_math_is_exact",
    "SCALED_MM_IS_NATIVE_ON_CPU",
]


def _onednn_compiles_fp8() -> bool:
    """Whether oneDNN has a compiled FP8 matmul on this CPU (see the module docstring)."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        return False  # an ISA cap may exclude AMX-FP16; the emulation is right either way
    amx_fp16 = getattr(torch.cpu, "_is_amx_fp16_supported", None)  # private: absent -> emulate
    return bool(amx_fp16 and amx_fp16() and torch.backends.mkldnn.is_available())


_FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32
_FLOAT32_MAX = torch.finfo(torch.float32).max

# Read by gemm._fp8_gemm on every CPU call, so a benchmark or test may set it to pick a path.
SCALED_MM_IS_NATIVE_ON_CPU = _onednn_compiles_fp8()


def _onednn_has_bf16_math() -> bool:
    """Whether oneDNN can run float32 matmuls in BF16 math here (torch >= 2.9's setting, a CPU
    with BF16 instructions); elsewhere setting the mode would only cost time."""
    settings = getattr(torch.backends.mkldnn, "matmul", None)
    if getattr(settings, "fp32_precision", None) is None:
        return False
    return onednn_has_16bit_kernels(torch.bfloat16) is True  # unknown: no BF16 math


def _bf16_math_setting() -> str:
    """``NVTE_CPU_GEMM_BF16_MATH``: ``auto`` (default: BF16 math while the process runs one
    Python thread), ``1`` (always: the user vouches that no other thread runs float32 CPU
    matmuls while an FP8 GEMM runs; progress-bar, logging or data-loading threads do not) or
    ``0`` (never)."""
    value = os.environ.get("NVTE_CPU_GEMM_BF16_MATH", "auto").strip().lower() or "auto"
    if value not in ("auto", "1", "0"):
        raise ValueError(
            f"NVTE_CPU_GEMM_BF16_MATH={value!r}: use 'auto' (BF16 math while one Python thread "
            "runs), '1' (always) or '0' (never)"
        )
    return value


# Read on every call, so a benchmark or test may set them to pick a path.
BF16_MATH_SETTING = _bf16_math_setting()
USE_BF16_MATH = _onednn_has_bf16_math()  # whether the mode exists here


# Per FP8 format: exponents of its smallest positive value and of a power of two above its
# largest (E4M3: 2**-9 and 448 < 2**9; E5M2: 2**-16 and 57344 < 2**16).
_EXPONENT_RANGE = {torch.float8_e4m3fn: (-9, 9), torch.float8_e5m2: (-16, 16)}


def bf16_math_is_exact(
    x_dtype: torch.dtype, x_scale_exponents, y_dtype: torch.dtype, y_scale_exponents, k: int
) -> bool:
    """Whether the float32 GEMM over ``k`` of two operands whose values are FP8 values (of
    ``x_dtype`` / ``y_dtype``) times powers of two ``2**s``, ``s`` within the ``(min, max)``
    scale exponents given, is exact up to the float32 accumulation order also in BF16 math:
    every value is then a BF16 number; required here, no operand value, product or nonzero
    partial sum below the smallest normal float32 (BF16 math flushes those; all are multiples
    of the smallest product), and no sum near overflow (``k`` products of the largest
    magnitudes). Block-scaled GEMMs (Float8 block, MXFP8) read their scales' exponents."""
    ranges = (_EXPONENT_RANGE.get(x_dtype), _EXPONENT_RANGE.get(y_dtype))
    if None in ranges:
        return False
    (x_lo, x_hi), (y_lo, y_hi) = ranges
    smallest = (x_scale_exponents[0] + x_lo, y_scale_exponents[0] + y_lo)
    largest_sum = x_scale_exponents[1] + x_hi + y_scale_exponents[1] + y_hi + max(k, 1).bit_length()
    return min(smallest) >= -126 and sum(smallest) >= -126 and largest_sum <= 127


def float32_product_of_fp8_values(xf: torch.Tensor, yf: torch.Tensor) -> torch.Tensor:
    """``xf @ yf.T`` in float32 for operands whose every value is an FP8 value times a power of
    two (module docstring): in oneDNN's BF16 math mode while this process runs one Python thread
    (nothing else can issue a matmul while the process-wide mode is set; it is restored even if
    the GEMM raises), else the plain float32 GEMM (``NVTE_CPU_GEMM_BF16_MATH``: see
    :func:`_bf16_math_setting`). Both are exact up to the float32 accumulation order."""
    if (
        not USE_BF16_MATH
        or BF16_MATH_SETTING == "0"
        or (BF16_MATH_SETTING == "auto" and threading.active_count() > 1)
    ):
        return torch.mm(xf, yf.t())
    settings = torch.backends.mkldnn.matmul
    previous = settings.fp32_precision
    if previous == "bf16":
        return torch.mm(xf, yf.t())
    settings.fp32_precision = "bf16"
    try:
        return torch.mm(xf, yf.t())
    finally:
        settings.fp32_precision = previous


def fp8_gemm_emulated(
    x: torch.Tensor,
    y: torch.Tensor,
    x_scale_inv: torch.Tensor,
    y_scale_inv: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(x * sx) @ (y * sy)^T (+ bias)`` for FP8 ``x [M, K]``, ``y [N, K]``, rounded once.

    ``x_scale_inv`` and ``y_scale_inv`` are one-element float32 tensors (any scalar factor such
    as ``alpha`` already folded in); ``bias`` is ``[N]`` of any float dtype or ``None``. The
    arguments are not checked: :func:`general_gemm` and the linear core have done that.
    """
    (xf, x_factor), (yf, y_factor) = fp8_to_float32_unscaled(x), fp8_to_float32_unscaled(y)
    product = float32_product_of_fp8_values(xf, yf)  # the product over x_factor * y_factor
    scale = x_scale_inv * y_scale_inv
    factor = x_factor * y_factor  # 1, 2**8 or 2**16
    if factor != 1.0:
        # The upcast's power-of-two factors, applied to the accumulator instead of to each
        # operand (module docstring: the result is the same, bit for bit). Folded into the
        # scale where that is exact: a normal scale whose product with the factor stays finite.
        s = abs(float(scale))
        if _FLOAT32_TINY <= s <= _FLOAT32_MAX / factor:
            scale = scale * factor
        else:
            product.mul_(factor)
    product.mul_(scale)
    if bias is not None:
        product.add_(bias)  # in-place into float32: the bias is upcast exactly, one rounding
    return product if out_dtype == torch.float32 else product.to(out_dtype)
