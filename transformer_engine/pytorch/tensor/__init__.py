"""Quantized tensor types: quantizers and the tensors they produce."""

from ..quantized_tensor import QuantizedTensor, QuantizedTensorStorage, Quantizer
from .float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor
from .float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor
from .hybrid_tensor import HybridQuantizedTensor, HybridQuantizedTensorStorage, HybridQuantizer
from .mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor
from .nvfp4_tensor import NVFP4Quantizer, NVFP4Tensor
from .storage.float8_blockwise_tensor_storage import Float8BlockwiseQTensorStorage
from .storage.float8_tensor_storage import Float8TensorStorage
from .storage.mxfp8_tensor_storage import MXFP8TensorStorage
from .storage.nvfp4_tensor_storage import NVFP4TensorStorage

__all__ = [
    "Quantizer",
    "QuantizedTensor",
    "QuantizedTensorStorage",
    "Float8Quantizer",
    "Float8CurrentScalingQuantizer",
    "Float8Tensor",
    "Float8TensorStorage",
    "Float8BlockQuantizer",
    "Float8BlockwiseQTensor",
    "Float8BlockwiseQTensorStorage",
    "MXFP8Quantizer",
    "MXFP8Tensor",
    "MXFP8TensorStorage",
    "NVFP4Quantizer",
    "NVFP4Tensor",
    "NVFP4TensorStorage",
    "HybridQuantizer",
    "HybridQuantizedTensor",
    "HybridQuantizedTensorStorage",
]
