"""Helpers shared by the general_gemm test files (test_gemm_fp8.py,
test_gemm_high_precision_and_mixed.py, test_gemm_validation.py, test_gemm_gpu.py): the output
dtypes, layouts, FP8 format pairs and operand shapes they are parametrized over, random inputs,
FP8 operands with their dequantized values, the float64 reference GEMM of each layout, and the
buffers each layout reads."""

from __future__ import annotations

import torch

from transformer_engine.pytorch import cpp_extensions as ext
from transformer_engine.pytorch.constants import DType, TE_DType_To_Torch, fp8_max
from transformer_engine.pytorch.cpp_extensions import Float8GemmOperand

E4M3, E5M2 = DType.kFloat8E4M3, DType.kFloat8E5M2
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
OUT_DTYPES = [BF16, FP16, FP32]
LAYOUTS = ["TN", "NN", "NT"]
# (A format, B format, tolerance row): E4M3 forward; HYBRID backward has an E5M2 gradient (B in
# dgrad and wgrad) against an E4M3 weight or input; the operand order is also tried reversed.
FORMATS = [(E4M3, E4M3, "e4m3"), (E4M3, E5M2, "hybrid"), (E5M2, E4M3, "hybrid")]
FORMAT_IDS = ["e4m3xe4m3", "e4m3xe5m2", "e5m2xe4m3"]

# Logical operand shapes per layout: (A, B, out). M is deliberately not a multiple of 16.
SHAPES = {
    "TN": ((48, 64), (2, 5, 64), (2, 5, 48)),  # A = weight [N, K], B = input [..., K]
    "NN": ((64, 48), (2, 5, 64), (2, 5, 48)),  # A = weight [K, N], B = grad [..., K]
    "NT": ((2, 16, 48), (2, 16, 40), (40, 48)),  # A = input [.., N], B = grad [.., M], K = 32
}


def randn(shape, seed, scale=1.0, dtype=FP32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)


def fp8_operand(t, fp8_dtype, *, rowwise=True, columnwise=True, device=None):
    """A plain-tensor FP8 operand (current scaling: amax maps to the FP8 max) and the
    dequantized float32 values it holds. Quantized on CPU, then moved to ``device``."""
    device = device or t.device
    torch_fp8 = TE_DType_To_Torch[fp8_dtype]
    amax = t.abs().max().float().cpu() if t.numel() else torch.tensor(1.0)
    scale = fp8_max(torch_fp8) / amax.clamp_min(1e-12).reshape(1)
    q = ext.quantize(t.detach().cpu(), scale, fp8_dtype, with_transpose=True)
    operand = Float8GemmOperand(
        data=q.data.to(device) if rowwise else None,
        transpose=q.transpose.to(device) if columnwise else None,
        scale_inv=q.scale_inv.to(device),
    )
    return operand, (q.data.float() * q.scale_inv).to(device)


def reference_gemm(layout, a, b):
    """The layout's row-major meaning, in float64, returned as float32."""
    a, b = a.double(), b.double()
    if layout == "TN":
        out = b.reshape(-1, a.shape[1]) @ a.t()
        return out.reshape(*b.shape[:-1], a.shape[0]).float()
    if layout == "NN":
        out = b.reshape(-1, a.shape[0]) @ a
        return out.reshape(*b.shape[:-1], a.shape[1]).float()
    return (b.reshape(-1, b.shape[-1]).t() @ a.reshape(-1, a.shape[-1])).float()


def operands(layout, seed=0, device="cpu"):
    """High-precision A and B for ``layout``, the weight-like operand scaled to ~N(0, 1/K)."""
    a_shape, b_shape, _ = SHAPES[layout]
    k = a_shape[1] if layout == "TN" else a_shape[0] if layout == "NN" else 32
    a = randn(a_shape, seed, k**-0.5 if layout != "NT" else 1.0, device=device)
    b = randn(b_shape, seed + 1, 1.0 if layout != "NT" else k**-0.5, device=device)
    return a, b


def usage_for(layout):
    """(A rowwise, A columnwise, B rowwise, B columnwise): the buffers each layout reads."""
    return {
        "TN": (True, False, True, False),
        "NN": (False, True, True, False),
        "NT": (False, True, False, True),
    }[layout]
