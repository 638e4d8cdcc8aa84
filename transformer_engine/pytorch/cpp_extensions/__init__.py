"""Kernel wrappers: validate torch tensors, then run natively (CUDA) or via the reference (CPU)."""

from .cast import QuantizeResult, compute_amax, dequantize, quantize, transposed_shape
from .float8_gemm_operand import Float8GemmOperand
from .gemm import general_gemm
from .grouped_gemm import general_grouped_gemm
from .normalization import layernorm_bwd, layernorm_fwd, rmsnorm_bwd, rmsnorm_fwd
from .scaling import (
    AMAX_COMPUTE_ALGOS,
    compute_scale_from_amax,
    delayed_scaling_update,
    fused_amax_and_scale_update_after_reduction,
)

__all__ = [
    "QuantizeResult",
    "quantize",
    "dequantize",
    "compute_amax",
    "transposed_shape",
    "general_gemm",
    "general_grouped_gemm",
    "layernorm_fwd",
    "layernorm_bwd",
    "rmsnorm_fwd",
    "rmsnorm_bwd",
    "Float8GemmOperand",
    "AMAX_COMPUTE_ALGOS",
    "compute_scale_from_amax",
    "delayed_scaling_update",
    "fused_amax_and_scale_update_after_reduction",
]
