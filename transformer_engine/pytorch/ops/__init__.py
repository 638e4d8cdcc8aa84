"""Fusible operations (``te.ops``): basic operations, fused operations, the fuser and
``Sequential``.

See ``docs`` in the module docstrings: ``op.py`` (the operation classes), ``fuser.py`` (the
device-correct, deferred-initialization-safe fuser) and ``sequential.py``.
"""

from . import fused  # registers the fusions
from .basic import (
    GEGLU,
    GELU,
    GLU,
    QGEGLU,
    QGELU,
    AddExtraInput,
    AllGather,
    AllReduce,
    BasicLinear,
    Bias,
    ClampedSwiGLU,
    ConstantScale,
    Dropout,
    GroupedLinear,
    Identity,
    L2Normalization,
    LayerNorm,
    MakeExtraOutput,
    Quantize,
    QuickGELU,
    ReduceScatter,
    ReGLU,
    ReLU,
    Reshape,
    RMSNorm,
    ScaledSwiGLU,
    SiLU,
    SReGLU,
    SReLU,
    SwiGLU,
)
from .fuser import (
    OperationFuser,
    register_backward_fusion,
    register_forward_backward_fusion,
    register_forward_fusion,
)
from .linear import Linear
from .op import BasicOperation, FusedOperation, FusibleOperation, OperationContext
from .sequential import Sequential

__all__ = [
    "AddExtraInput",
    "AllGather",
    "AllReduce",
    "BasicLinear",
    "BasicOperation",
    "Bias",
    "ClampedSwiGLU",
    "ConstantScale",
    "Dropout",
    "FusedOperation",
    "FusibleOperation",
    "GEGLU",
    "GELU",
    "GLU",
    "GroupedLinear",
    "Identity",
    "L2Normalization",
    "LayerNorm",
    "Linear",
    "MakeExtraOutput",
    "OperationContext",
    "OperationFuser",
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
    "Sequential",
    "SiLU",
    "SwiGLU",
    "fused",
    "register_backward_fusion",
    "register_forward_backward_fusion",
    "register_forward_fusion",
]
