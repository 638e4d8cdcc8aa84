"""PyTorch API of transformer_engine (``import transformer_engine.pytorch as te``).

What exists so far: FP8 recipes (``transformer_engine.common.recipe``), autocast and the
quantization state, quantized tensors, the FP8 cast kernels and GEMM
(``cpp_extensions``), their pure-PyTorch reference (``reference``) and the device seam.
"""

from . import cpp_extensions, distributed, ops, reference
from .constants import DType
from .distributed import checkpoint
from .module import (
    Fp8Padding,
    Fp8Unpadding,
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    RMSNorm,
    TransformerEngineBaseModule,
)
from .quantization import (
    FP8GlobalStateManager,
    autocast,
    fp8_autocast,
    fp8_model_init,
    get_default_recipe,
    is_fp8_available,
    quantized_model_init,
)
from .quantized_tensor import QuantizedTensor, Quantizer
from .tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor

__all__ = [
    "Linear",
    "LayerNormLinear",
    "LayerNormMLP",
    "GroupedLinear",
    "LayerNorm",
    "RMSNorm",
    "Fp8Padding",
    "Fp8Unpadding",
    "TransformerEngineBaseModule",
    "DType",
    "cpp_extensions",
    "reference",
    "distributed",
    "ops",
    "checkpoint",
    "FP8GlobalStateManager",
    "autocast",
    "fp8_autocast",
    "fp8_model_init",
    "get_default_recipe",
    "is_fp8_available",
    "quantized_model_init",
    "Quantizer",
    "QuantizedTensor",
    "Float8Quantizer",
    "Float8CurrentScalingQuantizer",
    "Float8Tensor",
]
