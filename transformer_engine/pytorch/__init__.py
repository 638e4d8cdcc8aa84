"""PyTorch API of transformer_engine.

At this stage it holds the FP8 cast kernels (``cpp_extensions``), their
pure-PyTorch reference (``reference``), the dtype constants and the device
seam; recipes, quantized tensors, modules and ops build on these.
"""

from . import cpp_extensions, reference
from .constants import DType

__all__ = ["DType", "cpp_extensions", "reference"]
