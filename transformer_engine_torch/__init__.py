"""``transformer_engine_torch``: upstream Transformer Engine's extension module, by name.

Upstream ships its C++ extension as this top-level module and its Python code, tests and
users do ``import transformer_engine_torch as tex``. Here it is a Python package over this
package's kernel wrappers (:mod:`transformer_engine.pytorch.cpp_extensions`: the native
library on CUDA tensors, the PyTorch reference elsewhere), with upstream's argument order and
meaning. It is a client of :mod:`transformer_engine.pytorch` and nothing in
``transformer_engine`` imports it.

Only what works is here: the enums and ``FP8TensorMeta``, the per-tensor FP8 quantize family,
``fp8_transpose``, ``generic_gemm`` (high precision and per-tensor FP8) and
``get_num_cublas_streams``, the LayerNorm/RMSNorm forward and
backward (with a quantized forward output), the fused delayed-scaling update, the
``multi_tensor_*`` optimizer operations (:mod:`transformer_engine.pytorch.optimizers`), the
version queries and ``thd_get_partitioned_indices`` (a rank's share of a packed batch under
context parallelism). docs/compatibility.md lists what each accepts and what it refuses.
"""

from transformer_engine.pytorch.attention.dot_product_attention.context_parallel import (
    thd_partitioned_indices as thd_get_partitioned_indices,
)
from transformer_engine.pytorch.cpp_extensions import (
    fused_amax_and_scale_update_after_reduction,
)
from transformer_engine.pytorch.optimizers import (
    multi_tensor_adam,
    multi_tensor_adam_capturable,
    multi_tensor_adam_capturable_master,
    multi_tensor_adam_param_remainder,
    multi_tensor_compute_scale_and_scale_inv,
    multi_tensor_l2norm,
    multi_tensor_scale,
    multi_tensor_sgd,
    multi_tensor_unscale_l2norm,
)

from ._enums import DType, FP8BwdTensors, FP8FwdTensors, FP8TensorMeta
from ._gemm import generic_gemm, get_num_cublas_streams
from ._normalization import (
    layernorm_bwd,
    layernorm_fwd,
    rmsnorm_bwd,
    rmsnorm_bwd_add,
    rmsnorm_fwd,
)
from ._quantize import (
    bgrad_quantize,
    compute_amax,
    create_empty_quantized_tensor,
    dequantize,
    fp8_transpose,
    multi_tensor_quantize,
    quantize,
    split_quantize,
)
from ._versions import get_cublasLt_version, get_cudnn_version

__all__ = [
    "thd_get_partitioned_indices",
    "DType",
    "FP8FwdTensors",
    "FP8BwdTensors",
    "FP8TensorMeta",
    "quantize",
    "dequantize",
    "bgrad_quantize",
    "create_empty_quantized_tensor",
    "multi_tensor_quantize",
    "split_quantize",
    "compute_amax",
    "fp8_transpose",
    "generic_gemm",
    "get_num_cublas_streams",
    "layernorm_fwd",
    "layernorm_bwd",
    "rmsnorm_fwd",
    "rmsnorm_bwd",
    "rmsnorm_bwd_add",
    "fused_amax_and_scale_update_after_reduction",
    "get_cublasLt_version",
    "get_cudnn_version",
    "multi_tensor_scale",
    "multi_tensor_l2norm",
    "multi_tensor_unscale_l2norm",
    "multi_tensor_adam",
    "multi_tensor_adam_param_remainder",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_sgd",
    "multi_tensor_compute_scale_and_scale_inv",
]
