"""Fused operations, registered with the fuser when this package is imported."""

from ..fuser import register_backward_fusion, register_forward_fusion
from .backward_activation_bias import BackwardActivationBias, fuse_backward_activation_bias
from .forward_linear_bias_activation import (
    ForwardLinearBiasActivation,
    fuse_forward_linear_bias_activation,
)

register_forward_fusion(fuse_forward_linear_bias_activation)
register_backward_fusion(fuse_backward_activation_bias)

__all__ = [
    "BackwardActivationBias",
    "ForwardLinearBiasActivation",
    "fuse_backward_activation_bias",
    "fuse_forward_linear_bias_activation",
]
