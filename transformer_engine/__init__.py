"""Transformer Engine for PyTorch: FP8 training that is correct on any device.

``import transformer_engine`` works with or without the native CUDA library;
``transformer_engine.native_status()`` tells which (``python -m
transformer_engine`` prints it).
"""

from .common.native import NativeStatus, native_status

__version__ = "0.1.0.dev0"

__all__ = ["NativeStatus", "native_status", "__version__"]
