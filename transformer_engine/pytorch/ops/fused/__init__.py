"""Fused operations, registered with the fuser when this package is imported.

Registration order is the order the fuser tries them in. The FP8 producer fusions come first
(``ForwardActivationCast`` and ``ForwardNormCast`` cover only the producer and leave the linear
after it to the linear fusions; ``BackwardActivationCast`` takes the ``BasicLinear[, Bias],
activation`` run before ``BackwardActivationBias`` would take its tail); among the others a
fusion covering more operations comes before one that would take a prefix of its run
(``BasicLinear, Bias`` followed by an in-place ``AddExtraInput`` is a ``ForwardLinearBiasAdd``,
not a ``ForwardLinearBiasActivation`` and a lone add), as upstream orders them.
``BackwardLinearBias`` comes last: a ``Bias`` before an activation goes to the activation's
fusions first.
"""

from ..fuser import register_backward_fusion, register_forward_fusion
from .backward_activation_bias import BackwardActivationBias, fuse_backward_activation_bias
from .backward_activation_cast import BackwardActivationCast, fuse_backward_activation_cast
from .backward_add_rmsnorm import BackwardAddRMSNorm, fuse_backward_add_rmsnorm
from .backward_linear_add import BackwardLinearAdd, fuse_backward_linear_add
from .backward_linear_bias import BackwardLinearBias, fuse_backward_linear_bias
from .backward_linear_scale import BackwardLinearScale, fuse_backward_linear_scale
from .forward_activation_cast import ForwardActivationCast, fuse_forward_activation_cast
from .forward_linear_bias_activation import (
    ForwardLinearBiasActivation,
    fuse_forward_linear_bias_activation,
)
from .forward_linear_bias_add import ForwardLinearBiasAdd, fuse_forward_linear_bias_add
from .forward_linear_scale_add import ForwardLinearScaleAdd, fuse_forward_linear_scale_add
from .forward_norm_cast import ForwardNormCast, fuse_forward_norm_cast

register_forward_fusion(fuse_forward_activation_cast)
register_forward_fusion(fuse_forward_norm_cast)
register_forward_fusion(fuse_forward_linear_bias_add)
register_forward_fusion(fuse_forward_linear_bias_activation)
register_forward_fusion(fuse_forward_linear_scale_add)
register_backward_fusion(fuse_backward_linear_add)
register_backward_fusion(fuse_backward_linear_scale)
register_backward_fusion(fuse_backward_activation_cast)
register_backward_fusion(fuse_backward_activation_bias)
register_backward_fusion(fuse_backward_add_rmsnorm)
register_backward_fusion(fuse_backward_linear_bias)

__all__ = [
    "BackwardActivationBias",
    "BackwardActivationCast",
    "BackwardAddRMSNorm",
    "BackwardLinearAdd",
    "BackwardLinearBias",
    "BackwardLinearScale",
    "ForwardActivationCast",
    "ForwardLinearBiasActivation",
    "ForwardLinearBiasAdd",
    "ForwardLinearScaleAdd",
    "ForwardNormCast",
    "fuse_backward_activation_bias",
    "fuse_backward_activation_cast",
    "fuse_backward_add_rmsnorm",
    "fuse_backward_linear_add",
    "fuse_backward_linear_bias",
    "fuse_backward_linear_scale",
    "fuse_forward_activation_cast",
    "fuse_forward_linear_bias_activation",
    "fuse_forward_linear_bias_add",
    "fuse_forward_linear_scale_add",
    "fuse_forward_norm_cast",
]
