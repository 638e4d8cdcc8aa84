"""Deprecated module name: use ``transformer_engine.pytorch.tensor.float8_tensor`` (or the
names at ``transformer_engine.pytorch``). Kept because code written for older releases imports
``Float8Tensor`` from here."""

import warnings

from .tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor

__all__ = ["Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8Tensor"]

warnings.warn(
    "transformer_engine.pytorch.float8_tensor is deprecated; import from "
    "transformer_engine.pytorch.tensor.float8_tensor",
    DeprecationWarning,
    stacklevel=2,
)
