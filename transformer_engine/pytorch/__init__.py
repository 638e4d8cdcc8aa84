"""PyTorch API of transformer_engine (``import transformer_engine.pytorch as te``).

The modules (``te.Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear``,
``LayerNorm``, ``RMSNorm``), attention and the composed layers (``te.DotProductAttention``,
``MultiheadAttention``, ``TransformerLayer``, RoPE, the KV cache), CUDA graphs
(``make_graphed_callables``), activation CPU offload (``get_cpu_offload_context``), the fusible
operations (``te.ops``), the fused optimizers (``te.optimizers``), autocast and the quantization
state, quantized tensors, the FP8 cast kernels and GEMM (``cpp_extensions``), their pure-PyTorch
reference (``reference``) and upstream's helper names. docs/architecture.md describes the layers.
"""

from . import attention, cpp_extensions, distributed, ops, optimizers, reference
from ._userbuffers import UserBufferQuantizationMode, destroy_ub, initialize_ub
from .attention import (
    DotProductAttention,
    InferenceParams,
    MultiheadAttention,
    RotaryPositionEmbedding,
)
from .constants import DType
from .cpu_offload import ManualOffloadSynchronizer, get_cpu_offload_context, mark_not_offload
from .cross_entropy import parallel_cross_entropy
from .distributed import CudaRNGStatesTracker, checkpoint
from .graph import make_graphed_callables
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
from .permutation import (
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)
from .quantization import (
    DelayedScalingRequest,
    FP8GlobalStateManager,
    QuantizerRequest,
    QuantizerRole,
    autocast,
    fp8_autocast,
    fp8_model_init,
    get_default_recipe,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
    quantized_model_init,
)
from .quantized_tensor import (
    QuantizedTensor,
    QuantizedTensorStorage,
    Quantizer,
    prepare_for_saving,
    restore_from_func_ctx,
    restore_from_saved,
)
from .tensor import (
    Float8BlockQuantizer,
    Float8BlockwiseQTensor,
    Float8BlockwiseQTensorStorage,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    Float8TensorStorage,
    MXFP8Quantizer,
    MXFP8Tensor,
    MXFP8TensorStorage,
    NVFP4Quantizer,
    NVFP4Tensor,
    NVFP4TensorStorage,
)
from .tensor.hybrid_tensor import (
    HybridQuantizedTensor,
    HybridQuantizedTensorStorage,
    HybridQuantizer,
)
from .tensor.identity_tensor import IdentityQuantizer
from .transformer import TransformerLayer
from .utils import (
    deinterleave_glu_tensor,
    get_cudnn_version,
    get_device_compute_capability,
    interleave_glu_tensor,
    is_bf16_available,
    torch_version,
)

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
    "DotProductAttention",
    "MultiheadAttention",
    "TransformerLayer",
    "InferenceParams",
    "RotaryPositionEmbedding",
    "CudaRNGStatesTracker",
    "make_graphed_callables",
    "initialize_ub",
    "destroy_ub",
    "UserBufferQuantizationMode",
    "get_cpu_offload_context",
    "mark_not_offload",
    "ManualOffloadSynchronizer",
    "attention",
    "DType",
    "cpp_extensions",
    "reference",
    "distributed",
    "ops",
    "optimizers",
    "parallel_cross_entropy",
    "moe_permute",
    "moe_permute_with_probs",
    "moe_permute_and_pad_with_probs",
    "moe_unpermute",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "checkpoint",
    "FP8GlobalStateManager",
    "autocast",
    "fp8_autocast",
    "fp8_model_init",
    "get_default_recipe",
    "is_fp8_available",
    "is_mxfp8_available",
    "is_fp8_block_scaling_available",
    "is_nvfp4_available",
    "quantized_model_init",
    "QuantizerRole",
    "QuantizerRequest",
    "DelayedScalingRequest",
    "Quantizer",
    "QuantizedTensor",
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
    "IdentityQuantizer",
    "HybridQuantizer",
    "HybridQuantizedTensor",
    "HybridQuantizedTensorStorage",
    "QuantizedTensorStorage",
    "prepare_for_saving",
    "restore_from_saved",
    "restore_from_func_ctx",
    "torch_version",
    "get_device_compute_capability",
    "get_cudnn_version",
    "is_bf16_available",
    "interleave_glu_tensor",
    "deinterleave_glu_tensor",
]
