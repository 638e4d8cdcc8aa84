"""Quantized buffers without a ``torch.Tensor`` wrapper (used inside modules)."""

from .float8_tensor_storage import Float8TensorStorage

__all__ = ["Float8TensorStorage"]
