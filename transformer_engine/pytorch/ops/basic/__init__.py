"""Basic operations of the fusible-ops API."""

from .activation import (
    GEGLU,
    GELU,
    GLU,
    QGEGLU,
    QGELU,
    ActivationOperation,
    ClampedSwiGLU,
    QuickGELU,
    ReGLU,
    ReLU,
    SiLU,
    SReGLU,
    SReLU,
    SwiGLU,
)
from .basic_linear import BasicLinear
from .bias import Bias
from .collectives import AllGather, AllReduce, ReduceScatter
from .extra_io import AddExtraInput, MakeExtraOutput
from .grouped_linear import GroupedLinear
from .l2_normalization import L2Normalization
from .normalization import LayerNorm, RMSNorm
from .quantize import Quantize
from .scaled_activation import ScaledSwiGLU
from .simple import ConstantScale, Dropout, Identity, Reshape

__all__ = [
    "ActivationOperation",
    "AddExtraInput",
    "AllGather",
    "AllReduce",
    "BasicLinear",
    "Bias",
    "ClampedSwiGLU",
    "ConstantScale",
    "Dropout",
    "GEGLU",
    "GELU",
    "GLU",
    "GroupedLinear",
    "Identity",
    "L2Normalization",
    "LayerNorm",
    "MakeExtraOutput",
    "QGEGLU",
    "QGELU",
    "Quantize",
    "QuickGELU",
    "RMSNorm",
    "ReduceScatter",
    "ReGLU",
    "ReLU",
    "Reshape",
    "SReGLU",
    "SReLU",
    "ScaledSwiGLU",
    "SiLU",
    "SwiGLU",
]
