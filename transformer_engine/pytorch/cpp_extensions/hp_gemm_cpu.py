"""16-bit (BF16, FP16) GEMMs on CPUs without 16-bit matrix math: in float32, rounded once.

PyTorch's CPU matmul hands BF16 and FP16 products to oneDNN only where oneDNN has kernels for
them (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: AVX-512 or AMX on x86, the BF16
extension on Arm; likewise for FP16). Everywhere else, for instance an AVX2-only AMD EPYC, it
falls back to a generic loop: a 1024x256x1024 BF16 product took 470 ms there against 7 ms for
the same product in float32, which made a BF16 step of the README's example six times slower
than its FP8 step (whose GEMMs are already float32 emulations, :mod:`.fp8_gemm_cpu`).

On such a CPU the high-precision GEMMs of the modules and ops (the linear core's forward,
dgrad and wgrad, :func:`.gemm.general_gemm`'s high-precision path) upcast their 16-bit
operands to float32 (exact), multiply and add the bias in float32, and round the result once
to the 16-bit dtype: a 16-bit GEMM with float32 accumulation, which is what the native kernels
compute too, up to the order of the float32 sums (and what a GPU's cuBLAS computes).
:data:`NATIVE_16BIT_GEMM` says which dtypes this CPU multiplies natively; a test or a benchmark
may change it to pick a route.
"""

from __future__ import annotations

import torch

from ._autocast_off import autocast_off

__all__ = [
    "NATIVE_16BIT_GEMM",
    "onednn_has_16bit_kernels",
    "runs_in_float32",
    "linear",
    "matmul",
]


def onednn_has_16bit_kernels(dtype: torch.dtype) -> bool | None:
    """Whether oneDNN has ``dtype`` (BF16 or FP16) matmul kernels for this CPU, so that
    PyTorch's CPU matmul hands it such products (module docstring); ``None`` where this torch
    lacks the private query that tells."""
    if not torch.backends.mkldnn.is_available():
        return False
    name = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    check = getattr(torch.ops.mkldnn, name[dtype], None)
    return None if check is None else bool(check())


# Read on every call (see the module docstring). An unknown answer keeps PyTorch's kernels.
NATIVE_16BIT_GEMM = {
    dtype: onednn_has_16bit_kernels(dtype) is not False for dtype in (torch.bfloat16, torch.float16)
}


def runs_in_float32(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the product of ``a`` and ``b`` takes the float32 route: both on the CPU, of one
    16-bit dtype this CPU does not multiply natively."""
    return (
        a.device.type == "cpu"
        and a.dtype == b.dtype
        and not NATIVE_16BIT_GEMM.get(a.dtype, True)
        and b.device.type == "cpu"
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)``, through float32 where
    :func:`runs_in_float32` (one rounding of product plus bias)."""
    if not runs_in_float32(x, weight) or (bias is not None and bias.dtype != x.dtype):
        return torch.nn.functional.linear(x, weight, bias)
    with autocast_off("cpu"):
        out = torch.nn.functional.linear(
            x.float(), weight.float(), None if bias is None else bias.float()
        )
    return out.to(x.dtype)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``, through float32 where :func:`runs_in_float32`."""
    if not runs_in_float32(a, b):
        return a @ b
    with autocast_off("cpu"):
        out = a.float() @ b.float()
    return out.to(a.dtype)
