"""Fused optimizers at upstream's path ``transformer_engine.pytorch.optimizers``.

``FusedAdam`` and ``FusedSGD`` with upstream's signatures, ``multi_tensor_applier`` and the
``multi_tensor_*`` operations it calls (the same ones ``transformer_engine_torch`` exports),
all on PyTorch's foreach kernels (docs/optimizers.md).
"""

from ._adam_math import (
    multi_tensor_adam,
    multi_tensor_adam_capturable,
    multi_tensor_adam_capturable_master,
    multi_tensor_adam_param_remainder,
)
from .fused_adam import FusedAdam
from .fused_sgd import FusedSGD
from .multi_tensor_apply import MultiTensorApply, multi_tensor_applier
from .multi_tensor_ops import (
    multi_tensor_compute_scale_and_scale_inv,
    multi_tensor_l2norm,
    multi_tensor_scale,
    multi_tensor_sgd,
    multi_tensor_unscale_l2norm,
)

__all__ = [
    "FusedAdam",
    "FusedSGD",
    "MultiTensorApply",
    "multi_tensor_applier",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_adam_param_remainder",
    "multi_tensor_compute_scale_and_scale_inv",
    "multi_tensor_l2norm",
    "multi_tensor_scale",
    "multi_tensor_sgd",
    "multi_tensor_unscale_l2norm",
]
